"""The opus command line under a pseudo-terminal of a given width, as a person typing it sees it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# rich reads these before the terminal itself; a CI runner that sets them must not decide the mode.
RICH_OVERRIDES = ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "NO_COLOR", "FORCE_COLOR")
# A smoke run takes 1-2 minutes on 2 idle cores and up to 10 on busy ones; a hang ends here.
SMOKE_TIMEOUT_S = 1200


@dataclass
class PtyResult:
    returncode: int
    output: str  # everything written to the terminal, control sequences included

    def tail(self, chars: int = 4000) -> str:
        return CSI.sub("", self.output)[-chars:]


def screen_rows(output: str) -> list[str]:
    """What the terminal showed row by row, cursor moves and colours stripped: a live display redraws
    its row after a carriage return, so every piece between returns is one drawn row."""
    return [piece for piece in re.split(r"[\r\n]", CSI.sub("", output)) if piece.strip()]


def run_in_pty(args: list[str | Path], columns: int, timeout_s: float, rows: int = 40) -> PtyResult:
    """``python -m opus.cli.main ARGS`` with stdin, stdout and stderr on a terminal COLUMNS wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in RICH_OVERRIDES}
    env.update(TERM="xterm-256color", COLUMNS=str(columns), LINES=str(rows), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "opus.cli.main", *map(str, args)], stdin=slave, stdout=slave,
                            stderr=slave, cwd=REPO, env=env, start_new_session=True)
    os.close(slave)
    try:
        output = _read_until_exit(master, proc, timeout_s)
    finally:
        os.close(master)
    return PtyResult(proc.wait(), output.decode("utf-8", errors="replace"))


def _read_until_exit(master: int, proc: subprocess.Popen, timeout_s: float) -> bytes:
    """Everything the command writes; reading all along, since a full terminal buffer blocks it."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer has closed the terminal
                data = b""
            if not data:
                return b"".join(chunks)
            chunks.append(data)
        elif proc.poll() is not None:
            return b"".join(chunks)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    text = CSI.sub("", b"".join(chunks).decode("utf-8", errors="replace"))
    raise AssertionError(f"still running after {timeout_s:g} s; its terminal showed:\n{text[-4000:]}")


@dataclass
class SmokeRun:
    run_dir: Path
    result: PtyResult
    summary: dict | None  # summary.json right after the run, before anything resumes it


def run_smoke(run_dir: Path) -> SmokeRun:
    """smoke.yaml as ``make smoke`` typed into a terminal 80 columns wide."""
    result = run_in_pty(["run", REPO / "pipelines" / "smoke.yaml", "--run-dir", run_dir], columns=80,
                        timeout_s=SMOKE_TIMEOUT_S)
    path = run_dir / "summary.json"
    return SmokeRun(run_dir, result, json.loads(path.read_text()) if path.is_file() else None)
