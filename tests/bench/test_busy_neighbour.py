"""bench/busy_neighbour.py refuses bad input before it runs anything: one line, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "busy_neighbour.py"


@pytest.mark.parametrize(("args", "message"), [
    (["--pipeline", "/nonexistent/k3.yaml"], "busy_neighbour: pipeline not found: /nonexistent/k3.yaml"),
    (["--busy", "0"], "busy_neighbour: --busy must be 1 or more, got 0"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--runs-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == message and done.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing ran
