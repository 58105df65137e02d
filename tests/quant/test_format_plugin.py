"""A new format in one file: this module defines W6A16 (int6 weights per channel), registers it, and
the plan config, the planner, apply, the recipe rebuild and promotion take it without any other edit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from opus.pipeline.spec import WorkloadSpec
from opus.quant.apply import quantize_model, rebuild
from opus.quant.calibrate import collect_stats
from opus.quant.formats import FORMATS, ExportMapping, Format, is_quantized, ladder, promote, register, unregister
from opus.quant.groups import uniform_assignment
from opus.quant.modules import QuantLinear
from opus.quant.plan import PlanRequest, make_plan
from stages.plan import Config as PlanConfig
from tests.quant.tiny import blocks, tiny_decoder

INT6_MAX = 31.0


def _int6_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / INT6_MAX
    return torch.round(w / scale[:, None]).clamp(-INT6_MAX, INT6_MAX).to(torch.int8), scale


class Int6WeightOnlyLinear(QuantLinear):
    """Int6 values stored one per int8 (a test format: the kernel is a dequantizing matmul)."""

    fmt = "w6a16"
    OUT_AXES = {"qweight": 0, "scale": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))

    def load_weight(self, weight: torch.Tensor) -> None:
        self.qweight, self.scale = _int6_per_channel(weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]).t()


@dataclass(frozen=True)
class Int6Format(Format):
    def fake_quant_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        q, scale = _int6_per_channel(weight)
        return (q.float() * scale[:, None]).to(weight.dtype)


W6A16 = Int6Format("w6a16", 6, rank=45, module=Int6WeightOnlyLinear, export=ExportMapping(None, "Q6_K"))


@pytest.fixture
def w6a16() -> Iterator[Format]:
    register(W6A16)
    try:
        yield W6A16
    finally:
        unregister(W6A16.name)


def test_plan_config_knows_it_only_once_registered(w6a16: Format) -> None:
    assert PlanConfig(formats=["w6a16", "w8a8"]).formats == ["w6a16", "w8a8"]
    unregister(w6a16.name)
    with pytest.raises(ValueError, match="unknown format 'w6a16'"):
        PlanConfig(formats=["w6a16"])
    register(w6a16)


def test_ladder_and_promotion_place_it_by_rank(w6a16: Format) -> None:
    assert ladder() == ("w4a16", "w8a8_tensor", "w8a8", "fp8", "w6a16", "w8a16", "bf16", "fp16", "fp32")
    assert promote("w8a8", ["w8a8", "w6a16"]) == "w6a16"
    assert promote("w6a16", ["w6a16", "w8a16"]) == "w8a16"


@torch.no_grad()
def test_apply_quantizes_with_it_and_the_recipe_rebuilds_it(w6a16: Format) -> None:
    model, data = tiny_decoder("llama"), blocks(2, 16)
    ref = model(data)
    assignment, skipped = uniform_assignment(model, "w6a16")
    assert assignment and not skipped
    step = quantize_model(model, assignment, None)
    assert {layer.format for layer in step.layers.values()} == {"w6a16"}
    assert all(is_quantized(model.get_submodule(name)) for name in assignment)
    out = model(data)
    assert 0 < float((out - ref).norm() / ref.norm()) < 0.2  # 6-bit weights in every linear, two layers
    fresh = rebuild(tiny_decoder("llama", seed=1), step)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(data), out)


@torch.no_grad()
def test_the_planner_scores_and_times_it_and_a_plan_may_name_it(w6a16: Format) -> None:
    model, data = tiny_decoder("llama"), blocks(2, 16)
    stats = collect_stats(model, data)
    request = PlanRequest(PlanConfig(formats=["w6a16"]).formats, budget_value=1.0, rounds=2)
    doc, _ = make_plan(model, data, stats, request, WorkloadSpec(batch_size=1, input_len=8, output_len=2))
    for group in doc.groups:
        assert "w6a16" in group.score and "w6a16" in group.time_ms
    # Chosen only where it beats float (this test kernel is a plain dequantizing matmul): name it by hand.
    assert set(doc.assignment().values()) <= {"w6a16", "fp32"}
    for group in doc.groups:
        group.format = "w6a16"
    assert set(doc.assignment().values()) == {FORMATS["w6a16"].name}
