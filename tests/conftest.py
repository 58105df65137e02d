import os
from pathlib import Path

import pytest

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
