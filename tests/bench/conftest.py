"""Shared by the bench tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():  # noqa: ANN201 - a fixture
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the bench sets the pipeline's thread count
