"""Quantized layers of one format merge in fusion (one GEMM, one activation quantization), exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opus.fusion import FusionConfig, apply_fusion, fuse_model, lm_probe
from opus.quant.apply import quantize_model, rebuild
from opus.quant.calibrate import collect_stats
from opus.quant.formats import FORMATS
from opus.quant.modules import concat_quantized
from tests.quant.tiny import blocks, tiny_decoder


@pytest.mark.parametrize("fmt", ["w8a8", "w8a16", "w4a16"])
@torch.no_grad()
def test_concat_equals_separate_layers(fmt: str) -> None:
    torch.manual_seed(0)
    layers = [FORMATS[fmt].build(nn.Linear(128, out), 64) for out in (128, 64, 64)]
    fused = concat_quantized(layers)
    x = torch.randn(5, 128)
    assert torch.equal(fused(x), torch.cat([m(x) for m in layers], dim=-1))


@torch.no_grad()
def test_mixed_formats_do_not_merge() -> None:
    layers = [FORMATS["w8a8"].build(nn.Linear(64, 64), 64), FORMATS["w8a16"].build(nn.Linear(64, 64), 64)]
    from opus.fusion.linear_ops import concat_linears

    assert "mixed precision" in concat_linears(layers)


@torch.no_grad()
def test_fusion_merges_quantized_qkv_and_replays_from_recipe() -> None:
    model = tiny_decoder("llama")
    data = blocks(2, 16)
    names = [n for n, _ in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]
    step = quantize_model(model, {n: "w8a8" for n in names}, collect_stats(model, data))
    ref = model(data)
    outcome = fuse_model(model, FusionConfig(patterns=["qkv", "gate_up"]), lm_probe(data))
    fused = outcome.model
    assert outcome.patterns()["qkv"]["fused"] == 2 and outcome.patterns()["gate_up"]["fused"] == 2
    assert torch.allclose(fused(data), ref, atol=1e-5)
    # Per layer: one qkv and one gate_up int8 layer remain, each a single GEMM.
    assert sum(type(m).__name__ == "Int8DynamicLinear" for m in fused.modules()) == 2 * 2
    rebuilt = apply_fusion(rebuild(tiny_decoder("llama"), step), outcome.step(None))
    rebuilt.load_state_dict(fused.state_dict())
    assert torch.allclose(rebuilt(data), ref, atol=1e-5)


@pytest.mark.parametrize("fmt", ["w8a8", "w4a16"])
@torch.no_grad()
def test_quantized_experts_are_grouped_and_replay_from_recipe(fmt: str) -> None:
    from opus.fusion.linear_ops import StackedQuantLinear
    from opus.fusion.moe import GroupedMoE

    model = tiny_decoder("mixtral")
    data = blocks(2, 16)
    names = [n for n, _ in model.named_modules() if ".experts." in n and n.endswith("_proj")]
    step = quantize_model(model, {n: fmt for n in names}, collect_stats(model, data), group_size=64)
    ref = model(data)
    outcome = fuse_model(model, FusionConfig(patterns=["moe_grouped"]), lm_probe(data))
    assert outcome.patterns()["moe_grouped"]["fused"] == 2
    moe = outcome.model.model.layers[0].mlp
    assert isinstance(moe, GroupedMoE) and isinstance(moe.experts.gate_up, StackedQuantLinear)
    assert moe.experts.gate_up.experts[0].fmt == fmt and moe.experts.down.experts[0].fmt == fmt
    assert torch.allclose(outcome.model(data), ref, atol=1e-5)
    rebuilt = apply_fusion(rebuild(tiny_decoder("mixtral"), step), outcome.step(None))
    rebuilt.load_state_dict(outcome.model.state_dict())
    assert torch.equal(rebuilt(data), outcome.model(data))


def test_fused_quantized_moe_exports_with_parity(tmp_path) -> None:  # noqa: ANN001
    """Exporters see every expert on every token (static shapes, no sort) and must match eager."""
    from opus.export.native import export_model
    from tests.stages.test_export import _assert_parity, _settings

    model = tiny_decoder("mixtral")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".experts." in n]
    step = quantize_model(model, {n: "w8a8" for n in names}, None)
    outcome = fuse_model(model, FusionConfig(patterns=["moe_grouped"]), lm_probe(blocks(2, 16)))
    assert outcome.patterns()["moe_grouped"]["fused"] == 2
    metrics, info = export_model(outcome.model, None, {"recipe": [step, outcome.step(None)]}, tmp_path / "x",
                                 _settings({"factory": "tests.quant.tiny:tiny_decoder", "args": {"family": "mixtral"}},
                                           hf=False, gguf=False))
    assert info["targets"]["onnx"]["exported"], info["targets"]["onnx"]["reason"]
    _assert_parity(metrics)


@torch.no_grad()
def test_experts_with_gate_up_and_down_in_different_formats_are_not_grouped() -> None:
    model = tiny_decoder("mixtral")
    data = blocks(2, 16)
    gate_up = [n for n, _ in model.named_modules() if ".experts." in n and n.endswith(("gate_proj", "up_proj"))]
    quantize_model(model, {n: "w8a8" for n in gate_up}, None)  # down_proj stays float (a normal plan)
    ref = model(data)
    outcome = fuse_model(model, FusionConfig(patterns=["moe_grouped"]), lm_probe(data))
    grouped = outcome.patterns()["moe_grouped"]
    assert grouped["fused"] == 0 and "gate/up and down differ in precision" in grouped["reasons"][0]
    assert torch.equal(outcome.model(data), ref)
