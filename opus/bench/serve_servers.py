"""The servers ``opus bench --serve`` drives: ``opus serve`` and llama-cpp-python's server, each a
subprocess on a free local port, with the same thread count.

A server is ready when its readiness URL answers 200 (``/health`` for opus serve; ``/v1/models`` for
llama-cpp-python, which loads its model before it listens). One that exits or stays unready past
the timeout is an error naming it, with the tail of its log. Stopping is SIGTERM, then a kill.

Each server is asked its own way not to stop at end of sequence, so output lengths are fixed:
opus serve takes ``ignore_eos`` (as vLLM does); llama-cpp-python's server has no such field, so
every end-of-generation token of the GGUF's vocabulary (``llama_vocab_is_eog``: EOS, EOT and the
like) gets a logit bias of -1e9 (``logit_bias``, applied by its sampler to every generated token).
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

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0
EOG_BIAS = -1e9  # JSON has no -inf; far below any logit, so never sampled, greedy or not
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
    model: str = ""  # the model id its /v1/models lists, filled in when ready
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Server:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing may download
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:  # a file, not a pipe: a chatty server never blocks on a full pipe
            # Its own session: a Ctrl-C at the terminal reaches the bench, which stops the server in order.
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self._wait_ready(timeout_s)
        models = json.loads(_get(self.url + "/v1/models", 10.0)[1] or b"{}").get("data") or []
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
        data = json.dumps({"input": text, "model": self.model}).encode()
        post = urllib.request.Request(self.url + self.count_path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=30) as response:
            return int(json.loads(response.read())["count"])

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


def _get(url: str, timeout_s: float) -> tuple[int | None, bytes | None]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
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


def eog_tokens(gguf: Path) -> list[int]:
    """The GGUF's end-of-generation token ids as llama.cpp itself decides them (its vocabulary only)."""
    import llama_cpp

    from opus.bench.llamacpp import _quiet_logs

    _quiet_logs(llama_cpp)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise ServerError(f"llama.cpp could not read the vocabulary of {gguf}")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        return [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    finally:
        llama_cpp.llama_model_free(model)


def llamacpp_server(gguf: Path, threads: int, n_ctx: int, log_dir: Path) -> Server:
    """llama-cpp-python's server on ``gguf``: ``threads`` for prompt and generation alike; logits of the
    last position only (its server defaults to ``logits_all``, every prompt position's vocabulary
    logits, which only logprobs need and which would slow its prefill for nothing). It runs one request
    at a time; ``interrupt_requests`` (on by default) would end the running stream early whenever
    another request waits, so under concurrent clients it is turned off: requests queue instead."""
    port = free_port()
    eog = eog_tokens(gguf)
    flags = ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
             "--logits_all", "false", "--interrupt_requests", "false", "--verbose", "false"]
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), *flags]
    note = (f"llama_cpp.server {' '.join(flags)}; fixed output lengths: logit_bias {EOG_BIAS:g} on its {len(eog)} "
            f"end-of-generation token(s) {eog[:8]}")
    return Server("llama.cpp", command, port, "/v1/models", log_dir / "llama-server.log",
                  {"logit_bias": {str(t): EOG_BIAS for t in eog}}, [note], count_path="/extras/tokenize/count")


def llamacpp_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))
