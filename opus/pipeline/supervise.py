"""The watchdog: start a stage worker, listen to its heartbeats, stop it when it hangs or overruns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opus.pipeline.contracts import Job, WorkerError
from opus.pipeline.worker import EXIT_DISK

POLL_S = 0.1


@dataclass
class WorkerOutcome:
    kind: str  # ok | crash | input | disk | stalled | timeout
    message: str = ""
    returncode: int | None = None


class _Listener(threading.Thread):
    """Reads JSON lines from the worker; every message is a heartbeat, and a progress message says
    whether torch is compiling (opus.compile_watch)."""

    def __init__(self, fd: int, on_message: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(daemon=True)
        self.stream = os.fdopen(fd, "r")
        self.on_message = on_message
        self.last_beat = time.monotonic()
        self.compiling = False
        self.last_phase = ""  # the last progress message's phase: where a stopped worker was

    def run(self) -> None:
        for line in self.stream:
            self.receive(line)

    def receive(self, line: str) -> None:
        self.last_beat = time.monotonic()
        try:
            message = json.loads(line)
        except ValueError:
            return
        if isinstance(message, dict) and message.get("t") == "progress":
            flag = message.get("compiling")  # absent: the state stands, as on the stage's line (progress.py)
            if isinstance(flag, bool):
                self.compiling = flag
            self.last_phase = _phase(message) or self.last_phase
        self.on_message(message)


def _phase(progress: dict[str, Any]) -> str:
    """A progress message as a person reads it: ``what done/total``."""
    done, total = progress.get("done"), progress.get("total")
    count = f"{done:g}" if isinstance(done, (int, float)) and done else ""
    if count and isinstance(total, (int, float)) and total:
        count += f"/{total:g}"
    return " ".join(x for x in (str(progress.get("what") or ""), count) if x)


def stall_reason(silent_s: float, compiling: bool, stall_timeout_s: float, compile_timeout_s: float,
                 phase: str = "") -> str | None:
    """Why a worker silent for ``silent_s`` in ``phase`` counts as hung, or None while it may still be working.

    A torch compile reports nothing until it ends and can take many minutes on a large model, so while
    one runs the limit is ``compile_timeout_s`` (never less than ``stall_timeout_s``)."""
    where = f" (last: {phase})" if phase else ""
    if compiling:
        limit, key = max((compile_timeout_s, "run.compile_timeout_s"), (stall_timeout_s, "run.stall_timeout_s"))
        if silent_s > limit:
            return f"torch compiled for {limit:g} s without finishing{where}; stopped ({key})"
        return None
    if silent_s > stall_timeout_s:
        return f"no progress for {stall_timeout_s:g} s{where}; stopped"
    return None


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:  # the group is gone
        return False


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop the worker and everything it started: SIGTERM to its process group, SIGKILL after a grace."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _reap_group(proc)


def _reap_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the worker's process group (a child that ignored SIGTERM, or one
    left running after the worker exited) and wait until the group is empty."""
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """True while a live (not zombie) process is in the group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def run_worker(job: Job, job_path: Path, log_path: Path, *, stall_timeout_s: float, compile_timeout_s: float,
               timeout_s: float | None, on_message: Callable[[dict[str, Any]], None],
               env: dict[str, str] | None = None) -> WorkerOutcome:
    """Run one attempt to completion, or stop it; KeyboardInterrupt stops the worker and re-raises."""
    job.write(job_path)
    read_fd, write_fd = os.pipe()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "opus.pipeline.worker", str(job_path), str(write_fd)],
            pass_fds=(write_fd,), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True)  # its own process group: stopping a stage stops all it started
    os.close(write_fd)
    listener = _Listener(read_fd, on_message)
    listener.start()
    started = time.monotonic()
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            now = time.monotonic()
            stalled = stall_reason(now - listener.last_beat, listener.compiling, stall_timeout_s, compile_timeout_s,
                                   listener.last_phase)
            if stalled:
                _stop(proc)
                return WorkerOutcome("stalled", stalled)
            if timeout_s is not None and now - started > timeout_s:
                _stop(proc)
                return WorkerOutcome("timeout", f"ran past its limit of {timeout_s:g} s; stopped")
    except BaseException:
        _stop(proc)
        raise
    finally:
        listener.join(timeout=2)
    _reap_group(proc)  # nothing a stage started outlives it
    if proc.returncode == 0:
        return WorkerOutcome("ok", returncode=0)
    error = WorkerError.read(job.out_dir)
    kind = "disk" if proc.returncode == EXIT_DISK else error.kind if error else "crash"
    message = (error.message if error else "") or (
        "no space left on device (the worker could not even write its error report)" if kind == "disk"
        else _describe_exit(proc.returncode))
    return WorkerOutcome(kind, f"{message} (log: {log_path})", proc.returncode)


def _describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " — killed, often by the kernel's out-of-memory killer" if name == "SIGKILL" else ""
        return f"worker died with {name}{hint}"
    return f"worker exited with code {code}"
