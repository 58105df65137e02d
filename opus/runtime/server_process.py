"""A server in a process of its own, on a free local port: started, waited for, stopped. ``opus serve``
here (``opus_server``: the serve_bench stage and ``opus bench --serve``); llama-cpp-python's server in
``opus.bench.serve_servers``.

A server is ready when its readiness URL answers 200 (``/health`` for opus serve; ``/v1/models`` for
llama-cpp-python, which loads its model before it listens). One that exits or stays unready past
the timeout is an error naming it, with the tail of its log. Stopping is SIGTERM, then a kill.

Each server is asked its own way not to stop at end of sequence (``Server.extra_body``), so output
lengths are fixed: opus serve takes ``ignore_eos`` (as vLLM does).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opus.errors import OpusError

READY_TIMEOUT_S = 900.0  # opus serve compiles a decode step per batch bucket before it is ready
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 15


class ServerError(OpusError):
    """A server that would not start, or died."""


@dataclass
class Server:
    name: str  # "opus" or "llama.cpp"
    command: list[str]
    port: int
    ready_path: str
    log: Path
    extra_body: dict[str, Any] = field(default_factory=dict)  # what each request adds for fixed lengths
    notes: list[str] = field(default_factory=list)
    count_path: str | None = None  # an endpoint that counts a text's tokens in the server's tokenizer
    count_style: str = "count"  # "count": {input, model} -> {count} (llama-cpp-python); "tokens": {content} -> {tokens}
    model: str = ""  # the model id its /v1/models lists, filled in when ready
    api_key: str | None = None  # sent as a bearer token when the server requires one
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Server:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing may download
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:  # a file, not a pipe: a chatty server never blocks on a full pipe
            # Its own session: a Ctrl-C at the terminal reaches the bench, which stops the server in order.
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self._wait_ready(timeout_s)
        models = json.loads(_get(self.url + "/v1/models", 10.0, self.headers)[1] or b"{}").get("data") or []
        if not models:
            raise ServerError(f"{self.name} server at {self.url} lists no model on /v1/models")
        self.model = str(models[0]["id"])
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"{self.name} server exited with code {code} before it was ready "
                                  f"({' '.join(self.command[:6])} …):\n{self.tail()}")
            status, _ = _get(self.url + self.ready_path, 2.0)
            if status == 200:
                return
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"{self.name} server not ready on {self.url}{self.ready_path} after {timeout_s:.0f} s:\n"
                          f"{self.tail()}")

    def count_tokens(self, text: str) -> int | None:
        """``text`` in the server's own tokenizer (None without a counting endpoint)."""
        if self.count_path is None:
            return None
        body = {"content": text} if self.count_style == "tokens" else {"input": text, "model": self.model}
        post = urllib.request.Request(self.url + self.count_path, json.dumps(body).encode(),
                                      {"Content-Type": "application/json", **self.headers})
        with urllib.request.urlopen(post, timeout=30) as response:
            answer = json.loads(response.read())
        return len(answer["tokens"]) if self.count_style == "tokens" else int(answer["count"])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> int | None:
        """SIGTERM (a server drains and exits), then SIGKILL after ``STOP_TIMEOUT_S``; its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:]) or "(no output)"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _get(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> tuple[int | None, bytes | None]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):  # refused, reset, timed out: not listening yet
        return None, None


def free_port() -> int:
    """A port free now (the OS picks it); the server binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def opus_server(target: Path, threads: int, log_dir: Path, max_batch: int | None = None,
                kv_budget_mb: float | None = None, eager: bool = False) -> Server:
    port = free_port()
    flags = ["--threads", str(threads)]
    if max_batch is not None:
        flags += ["--max-batch", str(max_batch)]
    if kv_budget_mb is not None:
        flags += ["--kv-budget-mb", f"{kv_budget_mb:g}"]
    if eager:
        flags.append("--eager")
    command = [sys.executable, "-m", "opus.cli.main", "serve", str(target), "--host", "127.0.0.1",
               "--port", str(port), *flags]
    return Server("opus", command, port, "/health", log_dir / "opus-serve.log", {"ignore_eos": True},
                  [f"opus serve {target} {' '.join(flags)}; fixed output lengths: ignore_eos"])
