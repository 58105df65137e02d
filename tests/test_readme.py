"""README as a user meets it: at most 300 lines, the blocks marked runnable run as written, and every
``opus`` command it shows exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
MARK = "<!-- runnable"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _runnable_blocks() -> list[str]:
    blocks = []
    for match in BLOCK.finditer(README):
        before = README[: match.start()].rstrip().splitlines()
        if before and before[-1].startswith(MARK):
            assert match.group(1) in ("bash", "sh"), "a runnable block is a shell block"
            blocks.append(match.group(2))
    return blocks


def test_readme_is_a_five_minute_read() -> None:
    assert len(README.splitlines()) <= 300


@pytest.mark.parametrize("block", _runnable_blocks())
def test_a_runnable_block_runs_as_written(block: str, tmp_path: Path) -> None:
    """In a fresh directory holding the repository's files as a user's checkout does, the `opus` of this
    environment first on the path."""
    for name in ("pipelines", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{block}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"


def test_there_are_runnable_blocks() -> None:
    assert len(_runnable_blocks()) >= 2


def test_every_opus_command_the_readme_shows_exists() -> None:
    from opus.cli.main import _groups

    known = {name for group in _groups() for name in group.COMMANDS}
    shown = set(re.findall(r"`opus ([a-z][a-z-]*)", README))
    for match in BLOCK.finditer(README):
        shown |= set(re.findall(r"^\s*opus ([a-z][a-z-]*)", match.group(2), re.M))
    assert shown and shown <= known, sorted(shown - known)
