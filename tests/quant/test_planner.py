"""The planner: fastest assignment within the budget, rules honoured, slower formats never chosen."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from opus.quant.calibrate import collect_stats
from opus.quant.groups import build_groups
from opus.quant.planner import Candidate, GroupChoice, budget_limit, plan_document, solve
from opus.quant.planning import PlanRequest, assignment_from_plan, make_plan
from opus.spec import WorkloadSpec
from tests.quant.tiny import blocks, tiny_decoder


def _group(name: str, float_ms: float, options: dict[str, tuple[float, float]], forced: str | None = None):
    cands = [Candidate("fp32", float_ms, 0.0)] + [Candidate(f, t, c, dce=c) for f, (t, c) in options.items()]
    return GroupChoice(name, "other", [name], float_ms, cands, forced)


def test_solver_maximizes_saving_within_budget() -> None:
    groups = [
        _group("a", 10.0, {"w8a8": (3.0, 0.010), "w4a16": (2.0, 0.030)}),
        _group("b", 10.0, {"w8a8": (3.0, 0.002), "w4a16": (2.5, 0.004)}),
        _group("c", 1.0, {"w8a8": (0.5, 0.020)}),
    ]
    chosen = solve(groups, limit=0.015)
    assert {k: v.fmt for k, v in chosen.items()} == {"a": "w8a8", "b": "w4a16", "c": "fp32"}
    assert sum(c.cost for c in chosen.values()) <= 0.015
    loose = solve(groups, limit=1.0)
    assert {k: v.fmt for k, v in loose.items()} == {"a": "w4a16", "b": "w4a16", "c": "w8a8"}


def test_slower_format_is_never_chosen_and_is_explained() -> None:
    groups = [_group("slow", 1.0, {"w4a16": (1.5, 0.0)}), _group("forced", 1.0, {"w8a8": (0.5, 0.0)}, "fp32")]
    chosen = solve(groups, limit=1.0)
    assert chosen["slow"].fmt == "fp32" and chosen["forced"].fmt == "fp32"
    doc = plan_document(groups, chosen, {"kind": "ppl", "value": 0.02}, 1.0)
    reasons = {g["name"]: g["reason"] for g in doc["groups"]}
    assert "slower than float here: w4a16" in reasons["slow"]
    assert reasons["forced"] == "forced to fp32 by a rule"
    assert doc["groups"][1]["time_ms"] == {"fp32": 1.0, "w4a16": 1.5}


def test_budget_units() -> None:
    assert budget_limit("ppl", 0.02, 10) == pytest.approx(math.log(1.02))
    assert budget_limit("bits", 8.0, 10) == 80.0


def test_groups_are_moe_aware_and_skip_tied_embeddings() -> None:
    model = tiny_decoder("mixtral")
    names = {g.name: g for g in build_groups(model, [], ["*.mlp.gate"])}
    qkv = names["model.layers.0.self_attn.qkv"]
    assert len(qkv.modules) == 3 and qkv.role == "attention"
    experts = names["model.layers.1.mlp.experts.gate_up"]
    assert len(experts.modules) == 8 and experts.role == "experts"
    assert "model.layers.0.mlp.gate" not in names
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert "lm_head" not in {g.name for g in build_groups(model, [], [])}


@torch.no_grad()
def test_make_plan_on_a_tiny_moe(tmp_path) -> None:  # noqa: ANN001
    model = tiny_decoder("mixtral", outlier=20.0)
    data = blocks(4, 32)
    stats = collect_stats(model, data)
    request = PlanRequest(["w8a8", "w8a16", "w4a16"], force={"*.mlp.gate": "fp32", "lm_head": "w8a16"},
                          budget_value=0.05)
    doc = make_plan(model, data, stats, request, WorkloadSpec(batch_size=2, input_len=16, output_len=4))
    groups = {g["name"]: g for g in doc["groups"]}
    assert groups["model.layers.0.mlp.gate"]["format"] == "fp32"
    assert groups["lm_head"]["format"] == "w8a16" and groups["lm_head"]["reason"] == "forced to w8a16 by a rule"
    qkv = groups["model.layers.0.self_attn.qkv"]
    assert set(qkv["score"]) == {"w8a8", "w8a16", "w4a16"} and all(r for r in qkv["reason"])
    assert doc["predicted"]["ppl_increase"] <= 0.05 * request.safety + 1e-9
    # The document is plain YAML a person can edit, and an edited plan is what gets applied.
    text = yaml.safe_dump(doc, sort_keys=False)
    edited = yaml.safe_load(text)
    edited["groups"][0]["format"] = "w4a16"
    assignment = assignment_from_plan(edited)
    assert all(assignment[m] == "w4a16" for m in edited["groups"][0]["modules"])
    edited["groups"][0]["format"] = "int3"
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        assignment_from_plan(edited)


def test_kernel_timing_sees_the_merged_gemms_fusion_will_run() -> None:
    from torch import nn

    from opus.quant.speed import merged_shapes

    model = tiny_decoder("llama")
    names = {g.name: g for g in build_groups(model, [], [])}
    assert names["model.layers.0.mlp.gate_up"].modules == ["model.layers.0.mlp.gate_proj",
                                                           "model.layers.0.mlp.up_proj"]
    qkv = names["model.layers.0.self_attn.qkv"].modules
    linears = [model.get_submodule(n) for n in qkv]
    assert merged_shapes(qkv, linears) == [(128, 128 + 64 + 64)]
    experts = ["m.experts.0.gate_proj", "m.experts.0.up_proj", "m.experts.1.gate_proj", "m.experts.1.up_proj"]
    assert merged_shapes(experts, [nn.Linear(8, 16)] * 4) == [(8, 32), (8, 32)]
