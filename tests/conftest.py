from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.pty_helpers import SmokeRun

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test runs two xdist workers on a 2-core machine: one thread each (and in the runs they
    # start), or the two OpenMP pools spin against each other on the same cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

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


def pytest_itemcollected(item: pytest.Item) -> None:
    """With ``-n 2`` (make test), keep on one xdist worker what must not be done twice or at once:
    the session's smoke run (computed once, by the worker that runs its users) and the Ray tests
    (each starts a local cluster sized to the machine)."""
    # Marked as each item is collected: xdist reads the groups in its collection_modifyitems.
    if "smoke_run" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("smoke"))
    elif "tests/cluster/" in item.nodeid:
        item.add_marker(pytest.mark.xdist_group("ray"))
