from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.pty_helpers import SmokeRun

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def one_thread():
    """One torch thread for in-process measurements: with 2 threads on a busy 2-core machine,
    OpenMP spin-waits made tiny-model timings swing by up to 100x. Restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> SmokeRun:
    """smoke.yaml run once per session under a pseudo-terminal: the suite's most expensive step,
    shared by test_pipelines (what the run produced) and test_terminal (what the terminal showed)."""
    from tests.pty_helpers import run_smoke

    return run_smoke(tmp_path_factory.mktemp("smoke") / "smoke")
