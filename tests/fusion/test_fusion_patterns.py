"""Each fusion pattern preserves outputs; the ignore list and the auto-ignore of untraceable code work."""

from __future__ import annotations

import pytest
import torch
from fusion_kit import Branchy, prompts, tiny_lm
from torch import nn

from opus.fusion import (
    FusionConfig,
    GroupedMoE,
    compare,
    fuse_model,
    lm_op_counts,
    lm_probe,
    lm_reference,
    region_nodes,
)
from opus.fusion.linear_ops import _GROUPED_OK, grouped_linear

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def fuse(model, **cfg):
    ids = prompts()
    ref = lm_reference(model, ids, 6)
    outcome = fuse_model(model, FusionConfig(**cfg), lm_probe(ids[:1, :8]))
    return outcome, compare(outcome.model, ref)


def assert_same(eq, tol=1e-5):
    assert eq["fusion_exact_match"] == 1.0
    assert eq["fusion_max_abs_diff"] < tol
    assert eq["fusion_cosine"] > 1 - 1e-6


EXPECTED = {  # pattern -> fused sites in a 2-layer tiny model of each family
    "llama": {"qkv": 2, "gate_up": 2, "silu_mul": 2, "add_rmsnorm": 2, "rmsnorm": 2},
    "qwen3": {"qkv": 2, "gate_up": 2, "silu_mul": 2, "add_rmsnorm": 2, "rmsnorm": 6},
    "mixtral": {"qkv": 2, "moe_grouped": 2, "add_rmsnorm": 2, "rmsnorm": 2},
}
CASES = [(family, pattern) for family, counts in EXPECTED.items() for pattern in counts]


@pytest.mark.parametrize("family,pattern", CASES)
def test_each_pattern_alone_preserves_outputs(family, pattern):
    patterns = [pattern] + (["gate_up"] if pattern == "silu_mul" else [])
    outcome, eq = fuse(tiny_lm(family), patterns=patterns)
    assert outcome.patterns()[pattern]["fused"] == EXPECTED[family][pattern]
    assert_same(eq)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "qwen2_moe"])
def test_all_patterns_together(family):
    model = tiny_lm(family)
    ids = prompts()
    nodes_before, ops_before = region_nodes(model)[0], lm_op_counts(model, ids[:1])
    outcome, eq = fuse(model)
    assert_same(eq)
    assert outcome.ignored == [] and outcome.sites
    fused = outcome.model
    assert region_nodes(fused)[0] < nodes_before
    ops_after = lm_op_counts(fused, ids[:1])
    assert ops_after["decode"] < ops_before["decode"] and ops_after["prefill"] < ops_before["prefill"]
    names = dict(fused.named_parameters())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    if fused.config.num_experts:
        moe = fused.model.layers[0].mlp
        assert isinstance(moe, GroupedMoE)
        assert moe.experts.gate_up.weight.shape == (4, 2 * 24, 32)  # stacked: no module per expert
        assert not any(".experts.0." in n for n in names)
    else:
        assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert fused.model.layers[0].self_attn.layer_idx == 0  # plain attributes survive the rewrite


def test_bfloat16_merges_in_bfloat16():
    outcome, eq = fuse(tiny_lm("qwen3", dtype=torch.bfloat16))
    assert outcome.patterns()["qkv"]["fused"] == 2
    assert outcome.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert eq["fusion_exact_match"] >= 0.95 and eq["fusion_cosine"] > 0.999


def test_ignore_globs_class_names_and_op_types():
    outcome, eq = fuse(tiny_lm("mixtral"), ignore=["*.self_attn", "SparseMoE", "rmsnorm", "model.layers.1"])
    pats = outcome.patterns()
    assert pats["qkv"]["fused"] == 0 and pats["moe_grouped"]["fused"] == 0 and pats["rmsnorm"]["fused"] == 0
    assert pats["add_rmsnorm"]["fused"] == 1  # layer 0 only: layer 1 is ignored as a whole
    ignored = {i["module"]: i["reason"] for i in outcome.ignored}
    assert set(ignored) >= {"model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.1",
                            "model.layers.0.mlp"}
    assert "ignored by config" in ignored["model.layers.0.self_attn"]
    assert any("op type 'rmsnorm'" in r for r in pats["rmsnorm"]["reasons"])
    assert any("module type 'SparseMoE'" in r for r in pats["moe_grouped"]["reasons"])
    assert not isinstance(outcome.model.model.layers[0].mlp, GroupedMoE)
    assert_same(eq)


def test_site_glob_skips_one_fusion():
    outcome, eq = fuse(tiny_lm("llama"), ignore=["model.layers.0.mlp.up_proj"])
    pats = outcome.patterns()
    assert pats["gate_up"] == {"fused": 1, "skipped": 1, "reasons": [pats["gate_up"]["reasons"][0]]}
    assert pats["gate_up"]["reasons"][0].startswith("ignored by config ('model.layers.0.mlp.up_proj')")
    assert pats["silu_mul"]["fused"] == 1  # the site reading up_proj in layer 0 is skipped too
    assert_same(eq)


def test_untraceable_module_is_auto_ignored_with_its_reason():
    model = tiny_lm("llama")
    model.model.layers[1].mlp = Branchy(model.model.layers[1].mlp)
    outcome, eq = fuse(model)
    ignored = {i["module"]: i["reason"] for i in outcome.ignored}
    assert list(ignored) == ["model.layers.1.mlp"]
    assert "trace failed" in ignored["model.layers.1.mlp"] and "control flow" in ignored["model.layers.1.mlp"]
    pats = outcome.patterns()
    assert pats["qkv"]["fused"] == 2 and pats["add_rmsnorm"]["fused"] == 2  # the rest still fused
    assert pats["gate_up"]["fused"] == 2  # the MLP inside the untraceable wrapper is its own region
    assert isinstance(outcome.model.model.layers[1].mlp, Branchy)
    assert isinstance(outcome.model.model.layers[1].mlp.inner, torch.fx.GraphModule)
    assert_same(eq)


class OddLinear(nn.Linear):
    """A linear subclass with no merge rule: stands in for a quantized linear."""


def test_mixed_experts_are_not_stacked():
    model = tiny_lm("mixtral")
    old = model.model.layers[0].mlp.experts[1].down_proj
    odd = OddLinear(old.in_features, old.out_features, bias=False)
    odd.load_state_dict(old.state_dict())
    model.model.layers[0].mlp.experts[1].down_proj = odd
    outcome, eq = fuse(model)
    pats = outcome.patterns()
    assert pats["moe_grouped"]["fused"] == 1 and pats["moe_grouped"]["skipped"] == 1
    assert "mixed/quantized experts: not stacked" in pats["moe_grouped"]["reasons"][0]
    assert not isinstance(outcome.model.model.layers[0].mlp, GroupedMoE)
    assert_same(eq)


def test_mixed_precision_linears_do_not_merge():
    model = tiny_lm("llama")
    model.model.layers[0].self_attn.v_proj.to(torch.float64)
    model.model.layers[0].self_attn.v_proj.forward = lambda x, m=model.model.layers[0].self_attn.v_proj: (
        nn.functional.linear(x.double(), m.weight).float())
    outcome, _ = fuse(model, patterns=["qkv"])
    assert outcome.patterns()["qkv"]["fused"] == 1
    assert "mixed precision" in outcome.patterns()["qkv"]["reasons"][0]


def test_grouped_linear_fallback_matches_grouped_mm(monkeypatch):
    x = torch.randn(9, 16)
    w = torch.randn(3, 8, 16)
    offsets = torch.tensor([4, 4, 9], dtype=torch.int32)  # expert 1 gets no token
    want = torch.cat([x[:4] @ w[0].T, x[4:9] @ w[2].T])
    got = grouped_linear(x, w, None, offsets)
    monkeypatch.setitem(_GROUPED_OK, ("cpu", torch.float32), False)
    padded = grouped_linear(x, w, None, offsets)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(padded, want, atol=1e-5)


def test_generic_module_traces_at_the_root():
    from opus.fusion import call_probe, generic_reference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(3, 8)
    ref = generic_reference(model, (x,))
    outcome = fuse_model(model, FusionConfig(), call_probe(x))
    assert outcome.ignored == [] and outcome.sites == []
    assert compare(outcome.model, ref)["fusion_exact_match"] == 1.0


def test_a_quantized_class_plugs_into_stacking(monkeypatch):
    from opus.fusion import linear_ops

    model = tiny_lm("mixtral")
    for layer in model.model.layers:
        for expert in layer.mlp.experts:  # every expert in one "format": stackable once rules exist
            for name in ("gate_proj", "up_proj", "down_proj"):
                old = getattr(expert, name)
                odd = OddLinear(old.in_features, old.out_features, bias=False)
                odd.load_state_dict(old.state_dict())
                setattr(expert, name, odd)
    monkeypatch.setitem(linear_ops._CONCAT, OddLinear, linear_ops._concat_linear)
    monkeypatch.setitem(linear_ops._STACK, OddLinear, linear_ops._stack_linear)
    outcome, eq = fuse(model, patterns=["moe_grouped"])
    assert outcome.patterns()["moe_grouped"]["fused"] == 2
    assert_same(eq)
