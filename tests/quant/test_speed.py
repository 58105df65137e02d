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


def test_a_model_with_more_linear_shapes_than_dynamos_recompile_limit_is_timed_compiled() -> None:
    """A real model's planner times a dozen or more (in, out, rows) shapes through one compiled caller. A float
    linear's Parameters kept their shapes static in dynamo, one graph per shape: the ninth failed the plan stage
    (FailOnRecompileLimitHit) on the GPU pipeline's toy model and would on any real LLM."""
    for in_features in range(32, 32 * 11, 32):  # ten shapes, each new to this process
        taken = time_formats(["fp32"], Shape(in_features, 48, 64), "cpu", torch.float32, 32, rounds=1, compiled=True)
        assert len(taken["fp32"]) == 1


class RecordingTimer:
    """Stands in for KernelTimer: records the (in, out, rows) shapes asked for, each taking 1 ms a round."""

    rounds = 3

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int]] = []

    def __call__(self, formats: list[str], shape: Shape) -> dict[str, list[float]]:
        self.asked.append((shape.in_features, shape.out_features, shape.rows))
        return {fmt: [1.0] * self.rounds for fmt in formats}


@pytest.mark.parametrize("dense_decode", [False, True])
def test_a_compiled_decode_step_times_the_experts_as_the_dense_mode_runs_them(dense_decode: bool) -> None:
    """Compiled, a decode step runs a MoE layer's experts dense (opus.fusion.moe): each expert on every row,
    and their gate/up as one GEMM. Eagerly (sorted) each expert sees its share of the routed rows."""
    from types import SimpleNamespace

    from torch import nn

    workload = SimpleNamespace(batch_size=32, input_len=16, output_len=8)
    prefix = "model.layers.0.mlp.experts"
    gate_up = [f"{prefix}.{e}.{proj}" for e in range(4) for proj in ("gate_proj", "up_proj")]
    timer = RecordingTimer()
    totals = speed.group_rounds_ms(timer, ["fp32"], gate_up, [nn.Linear(8, 6)] * 8, "experts", workload, 4, 2,
                                   dense_decode=dense_decode)
    prefill = [(8, 12, 32 * 16 * 2 // 4)] * 4  # per expert, gate and up merged: its share of the routed rows
    decode = [(8, 48, 32)] if dense_decode else [(8, 12, 32 * 2 // 4)] * 4
    assert timer.asked == prefill + decode
    assert totals["fp32"] == [4 + len(decode) * 8] * 3  # one prefill, output_len decode steps
    down = [f"{prefix}.{e}.down_proj" for e in range(4)]
    timer = RecordingTimer()
    speed.group_rounds_ms(timer, ["fp32"], down, [nn.Linear(6, 8)] * 4, "experts", workload, 4, 2,
                          dense_decode=dense_decode)
    assert timer.asked[4:] == [(6, 8, 32 if dense_decode else 16)] * 4  # each reads its own rows: never merged


def test_experts_too_big_to_merge_keep_their_gemms_in_the_dense_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    names = [f"model.layers.0.mlp.experts.{e}.{proj}" for e in range(2) for proj in ("gate_proj", "up_proj")]
    linears = [nn.Linear(8, 6)] * 4
    assert speed.decode_shapes(names, linears, "experts", True) == [(8, 24)]
    monkeypatch.setattr(speed, "MERGED_EXPERTS_MAX_BYTES", 8 * 24 - 1)
    assert speed.decode_shapes(names, linears, "experts", True) == [(8, 12), (8, 12)]
