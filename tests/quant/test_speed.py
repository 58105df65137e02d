"""Kernel timings for the planner (opus.quant.speed): for a model that will run compiled, a format with a
pure kernel is timed through inductor too, and each round keeps the faster way."""

from __future__ import annotations

import pytest
import torch

from opus.quant import speed
from opus.quant.speed import Shape, time_formats


@pytest.mark.parametrize("rows", [64, 4])  # prefill-sized (W8A8 has a pure kernel), decode-sized (it has none)
def test_compiled_timings_join_the_eager_ones_and_each_round_keeps_the_faster(rows: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, list[float]] = {}
    interleave = speed.interleave

    def recording(options, rounds, **kwargs):  # noqa: ANN001, ANN202
        seen.update(interleave(options, rounds, **kwargs))
        return seen

    monkeypatch.setattr(speed, "interleave", recording)
    taken = time_formats(["fp32", "w8a8"], Shape(64, 96, rows), "cpu", torch.float32, 32, rounds=3, compiled=True)
    expected = {"fp32", "fp32 compiled", "w8a8"} | ({"w8a8 compiled"} if rows > 16 else set())
    assert set(seen) == expected
    for fmt in ("fp32", "w8a8"):
        both = zip(seen[fmt], seen.get(f"{fmt} compiled", seen[fmt]))
        assert taken[fmt] == pytest.approx([min(pair) * 1e3 for pair in both])
    seen.clear()
    time_formats(["fp32", "w8a8"], Shape(64, 96, rows), "cpu", torch.float32, 32, rounds=3)
    assert set(seen) == {"fp32", "w8a8"}  # an eager runtime: eager timings only
