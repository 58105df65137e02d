"""What the tests of Opus's C++ ops (opus.cpp_build) share: build one, or skip where no compiler is."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from opus.bench.torch_contenders import find_cxx


def built_or_skip(load: Callable[[], str | None], what: str) -> None:
    """``load()`` the op (building it once); skip without a C++ compiler, fail if one is here and it did not build."""
    if find_cxx() is None:
        pytest.skip(f"{what} are built with a C++ compiler; none found")
    reason = load()
    if reason is not None:
        pytest.fail(f"a compiler is here, yet {reason}")


def on_threads(run: Callable[[], object], counts: tuple[int, ...] = (1, 2)) -> list[object]:
    """``run()``'s result at each thread count in turn (torch's intra-op threads restored after)."""
    before = torch.get_num_threads()
    try:
        results = []
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(run())
        return results
    finally:
        torch.set_num_threads(before)
