"""The planner: fastest assignment within the budget, rules honoured, slower formats never chosen."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from opus.errors import InputError
from opus.pipeline.spec import WorkloadSpec
from opus.quant.calibrate import collect_stats
from opus.quant.groups import build_groups
from opus.quant.knapsack import Candidate, GroupChoice, budget_limit, plan_document, solve
from opus.quant.plan import PlanRequest, make_plan
from opus.quant.plan_file import plan_from_data
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


def test_a_format_within_the_noise_of_a_more_accurate_one_is_chosen_only_where_that_one_does_not_fit() -> None:
    from torch import nn

    from opus.quant.groups import QGroup
    from opus.quant.plan import _group_choice

    def choice(w4_ms: float, kind: str) -> GroupChoice:  # steady timings: the margin is the 2% floor
        samples = {"fp32": [10.0] * 3, "w8a16": [5.0] * 3, "w4a16": [w4_ms] * 3}
        scores = {"w8a16": {"dce": 0.001}, "w4a16": {"dce": 0.01}}
        group = QGroup("g", ["g"])
        return _group_choice(group, [nn.Linear(64, 64)], None, samples, scores, kind)[0]

    def planned(group: GroupChoice, kind: str, limit: float) -> str:
        return solve([group], limit)[group.name].fmt

    tied = choice(4.95, "ppl")  # 1% faster than w8a16 but 10x the Δce: no credible gain
    assert planned(tied, "ppl", 1.0) == "w8a16"
    doc = plan_document([tied], {"g": tied.candidates[1]}, {"kind": "ppl", "value": 1.0}, 1.0)
    assert doc["groups"][0]["time_ms"]["w4a16"] == 4.95 and doc["groups"][0]["margin"] == 0.02
    assert "within the 2.0% noise margin, so no faster: w4a16" in doc["groups"][0]["reason"]
    assert planned(choice(4.0, "ppl"), "ppl", 1.0) == "w4a16"  # 20% faster: beyond the noise
    # Under a memory budget that w8a16 does not fit, the tie's loser is still faster than float.
    w4_bytes = 64 * 64 * 4.25 / 8
    assert planned(choice(4.95, "memory"), "memory", w4_bytes + 1) == "w4a16"


def test_budget_units() -> None:
    assert budget_limit("ppl", 0.02, 10) == pytest.approx(math.log(1.02))
    assert budget_limit("bits", 8.0, 10) == 80.0


def test_groups_are_moe_aware_and_tied_heads_are_opt_in() -> None:
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
    assert names["lm_head"].role == "lm_head"
    assert "lm_head" in {g.name for g in build_groups(model, [], [], tied=True)}


@torch.no_grad()
def test_scoring_a_tied_head_leaves_the_embedding_float() -> None:
    from opus.quant.sensitivity import measure_sensitivity

    model = tiny_decoder("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    table = model.model.embed_tokens.weight.detach().clone()
    head = [g for g in build_groups(model, [], [], tied=True) if g.name == "lm_head"]
    scores = measure_sensitivity(model, head, ["w4a16"], blocks(2, 16), group_size=32)
    assert scores["lm_head"]["w4a16"]["kl"] > 0
    assert torch.equal(model.model.embed_tokens.weight, table)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied afterwards


@torch.no_grad()
def test_quantized_tied_head_gets_its_own_copy_and_round_trips() -> None:
    from opus.models.saved_state import changed_tensors
    from opus.quant.apply import quantize_model, rebuild

    def tied() -> torch.nn.Module:
        model = tiny_decoder("llama")
        model.config.tie_word_embeddings = True
        model.tie_weights()
        return model

    model, data = tied(), blocks(2, 16)
    table = model.model.embed_tokens.weight.detach().clone()
    float_logits = model(data)
    marks = {n: (t.data_ptr(), t._version) for n, t in model.state_dict(keep_vars=True).items()}
    step = quantize_model(model, {"lm_head": "w8a8"}, None)
    out = model(data)
    assert torch.equal(model.model.embed_tokens.weight, table)
    assert 0 < float((out - float_logits).norm() / float_logits.norm()) < 0.02
    tensors, _ = changed_tensors(model, marks)
    assert "lm_head.qweight" in tensors and "model.embed_tokens.weight" not in tensors
    fresh = rebuild(tied(), step)
    fresh.load_state_dict(tensors, strict=False)
    assert torch.equal(fresh(data), out)


@torch.no_grad()
def test_make_plan_on_a_tiny_moe(tmp_path) -> None:  # noqa: ANN001
    model = tiny_decoder("mixtral", outlier=20.0)
    data = blocks(4, 32)
    stats = collect_stats(model, data)
    request = PlanRequest(["w8a8", "w8a16", "w4a16"], force={"*.mlp.gate": "fp32", "lm_head": "w8a16"},
                          budget_value=0.05)
    doc, decisions = make_plan(model, data, stats, request, WorkloadSpec(batch_size=2, input_len=16, output_len=4))
    groups = {g.name: g for g in doc.groups}
    # Every group's kernel timing is a decision of the shared rule: interleaved rounds and a margin.
    assert sorted(d.what for d in decisions) == sorted(f"kernel formats: {name}" for name in groups)
    assert all(len(v) in (request.rounds, 2 * request.rounds) for d in decisions for v in d.samples.values())
    for d in decisions:  # where budget or rules overrule the group's own pick, its record says so
        fmt = groups[d.what.removeprefix("kernel formats: ")].format
        assert d.winner == fmt or f"the plan has {fmt}" in d.reason
    assert all(g.margin >= 0.02 for g in doc.groups)
    assert groups["model.layers.0.mlp.gate"].format == "fp32"
    assert groups["lm_head"].format == "w8a16" and groups["lm_head"].reason == "forced to w8a16 by a rule"
    qkv = groups["model.layers.0.self_attn.qkv"]
    assert set(qkv.score) == {"w8a8", "w8a16", "w4a16"} and qkv.reason
    # Each group says how its scores were obtained; the sweep says how many units it measured.
    assert qkv.scored_by == "suffix from layer 0, top-64 + target + tail"
    assert groups["model.layers.1.mlp.experts.down_proj"].scored_by.startswith("suffix from layer 1")
    assert doc.sensitivity.pop("seconds") > 0
    assert doc.sensitivity == {"method": "suffix", "top_k": 64, "units": 24, "measured": 24, "reused": 0,
                               "ran_on": {"this process": 24}}
    assert doc.predicted.ppl_increase <= 0.05 * request.safety + 1e-9
    # The document is plain YAML a person can edit, and an edited plan is what gets applied.
    edited = yaml.safe_load(doc.to_yaml())
    assert edited["version"] == 1
    edited["groups"][0]["format"] = "w4a16"
    assignment = plan_from_data(edited, "plan.yaml").assignment()
    assert all(assignment[m] == "w4a16" for m in edited["groups"][0]["modules"])
    edited["groups"][0]["format"] = "int3"
    with pytest.raises(InputError, match=r"plan.yaml: groups.0.format: unknown format 'int3'"):
        plan_from_data(edited, "plan.yaml")
    edited["groups"][0]["format"], edited["groups"][0]["fromat"] = "w4a16", "w8a8"  # a typo is a key named
    with pytest.raises(InputError, match=r"plan.yaml: groups.0.fromat: not a field of a plan"):
        plan_from_data(edited, "plan.yaml")


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


def test_uniform_alternatives_respect_budget_rules_and_kernels() -> None:
    from opus.quant.validate import uniform_alternatives

    groups = [
        _group("a", 10.0, {"w8a8": (3.0, 0.010), "w4a16": (2.0, 0.030)}),
        _group("b", 10.0, {"w8a8": (3.0, 0.002)}),  # no int4 kernel for this one: stays float
        _group("r", 1.0, {"w8a8": (0.5, 0.0)}, forced="fp32"),
    ]
    alternatives, notes = uniform_alternatives(groups, ["w8a8", "w4a16"], limit=0.02)
    assert {g: c.fmt for g, c in alternatives["uniform w8a8"].items()} == {"a": "w8a8", "b": "w8a8", "r": "fp32"}
    assert "uniform w4a16" not in alternatives and "over the budget" in notes[0]
    loose, _ = uniform_alternatives(groups, ["w4a16"], limit=1.0)
    assert {g: c.fmt for g, c in loose["uniform w4a16"].items()} == {"a": "w4a16", "b": "fp32", "r": "fp32"}
    # Given the plan, an alternative whose kernels alone take over twice the plan's is not timed.
    slow = [_group("a", 10.0, {"w8a8": (3.0, 0.010), "w4a16": (40.0, 0.001)}),
            _group("b", 10.0, {"w8a8": (3.0, 0.002), "w4a16": (4.0, 0.001)}), groups[2]]
    plan = {g.name: next(c for c in g.candidates if c.fmt == ("fp32" if g.name == "r" else "w8a8"))
            for g in slow}  # 3 + 3 + 1 (forced fp32) ms
    kept, why = uniform_alternatives(slow, ["w8a8", "w4a16"], limit=1.0, planned=plan)
    assert list(kept) == ["uniform w8a8"] and "6.4× the plan's 7 ms" in why[0], why


def test_workload_prompts_cut_from_calibration_text() -> None:
    from opus.quant.validate import workload_prompts

    text = torch.arange(30).reshape(3, 10)
    prompts = workload_prompts(text, 4, 12)
    assert prompts.shape == (4, 12)
    assert prompts.reshape(-1)[:30].tolist() == list(range(30)) and prompts[2, 6] == 0  # wraps around


@torch.no_grad()
def test_plan_is_checked_end_to_end_against_uniform_formats() -> None:
    model = tiny_decoder("mixtral", outlier=20.0)
    data = blocks(4, 32)
    stats = collect_stats(model, data)
    from opus.fusion.ready_to_time import fused_and_compiled

    readied: list[str] = []

    def prepare(contender: torch.nn.Module, prompt: torch.Tensor):  # noqa: ANN202
        readied.append(type(contender).__name__)
        return fused_and_compiled(contender, prompt)

    request = PlanRequest(["w8a8", "w8a16"], force={"*.mlp.gate": "fp32"}, budget_value=0.5, validate=True,
                          check_prepare=prepare, check_runtime="compiled: fused, static KV cache")
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    doc, decisions = make_plan(model, data, stats, request, WorkloadSpec(batch_size=2, input_len=16, output_len=4))
    measured = doc.measured
    contenders = measured["contenders"]
    # Each uniform format was timed, or a note says why not: it is the plan itself, or (on a CPU whose int8
    # GEMMs are slow, such as one without VNNI) its kernels alone took over twice the plan's.
    for fmt in request.formats:
        name = f"uniform {fmt}"
        why_not = (f"{name} is the per-layer plan itself", f"{name} not measured: its kernels alone")
        assert name in contenders or any(n.startswith(why_not) for n in doc.notes), doc.notes
    assert "plan" in contenders and len(contenders) >= 2, doc.notes  # something was checked end to end
    # Every contender was readied to run as the later stages run it (fused, compiled decode steps).
    assert len(readied) == len(contenders) and measured["runtime"] == "compiled: fused, static KV cache"
    check = decisions[-1]
    for name, row in contenders.items():  # batch ms: the median over rounds of prefill + 3 decode steps
        assert row["batch_ms"] == round(check.medians[name], 2)
        assert len(check.samples[name]) in (request.rounds, 2 * request.rounds)  # twice: measured once more
        assert row["prefill_ms"] > 0 and row["decode_step_ms"] > 0
    # The shared rule picked: of the contenders tied with the fastest, the one predicted most accurate.
    assert check.what == "end-to-end check" and check.winner == measured["kept"] and measured["margin"] >= 0.02
    medians = check.medians
    fastest = min(medians, key=medians.get)
    assert set(check.tied) == {n for n in medians if medians[n] <= medians[fastest] * (1 + check.margin)}
    assert measured["kept"] == min(check.tied, key=lambda n: (check.options[n].error, check.options[n].simplicity))
    if measured["kept"] != "plan":  # a uniform format won: the document is that format
        fmt = measured["kept"].split()[-1]
        assert {g.format for g in doc.groups if not g.reason.startswith("forced")} <= {fmt, "fp32"}
    # The contenders were built from copies: the planner's own model is only smoothed, never quantized.
    assert not any(t.dtype == torch.int8 for t in model.state_dict().values())
    assert set(model.state_dict()) == set(weights)


def test_the_end_to_end_check_runs_compiled_where_the_static_cache_can_else_eager() -> None:
    from opus.quant.validate import check_runtime

    decoder, other = tiny_decoder("llama"), torch.nn.Linear(4, 4)
    assert check_runtime(decoder, "auto") == ("compiled", "compiled: fused, static KV cache")
    assert check_runtime(decoder, "eager") == ("eager", "eager")
    runtime, why = check_runtime(other, "auto")
    assert runtime == "eager"
    assert why == "eager: Linear is not an Opus decoder, which alone hands decode steps to the cache"
    with pytest.raises(ValueError, match="cannot run compiled: Linear is not an Opus decoder"):
        check_runtime(other, "compiled")
    with pytest.raises(ValueError, match="one of auto, compiled, eager"):
        check_runtime(decoder, "jit")


@torch.no_grad()
def test_sensitivity_progress_reaches_its_total_when_a_format_cannot_take_a_layer() -> None:
    from opus.quant.sensitivity import measure_sensitivity

    model = tiny_decoder("llama")
    groups = [g for g in build_groups(model, [], []) if g.name in ("lm_head", "model.layers.0.self_attn.o_proj")]
    seen: list[tuple[float, float]] = []
    # group size 96 divides no 128-wide input: w4a16 cannot take these layers and is skipped
    scores = measure_sensitivity(model, groups, ["w8a16", "w4a16"], blocks(2, 16), group_size=96,
                                 progress=lambda done, total, _: seen.append((done, total)))
    assert all("w4a16" not in by_fmt for by_fmt in scores.values()) and scores
    assert seen[-1] == (4, 4)


def test_a_compiled_runtime_plans_a_layers_experts_as_one_group() -> None:
    """Fused, a MoE layer's experts are grouped (and run fast) only where gate/up and down share a format,
    so a plan for the compiled runtime gives them one: one group per layer, timed as the GEMMs it runs."""
    from opus.quant.speed import decode_shapes, merged_shapes

    model = tiny_decoder("mixtral", outlier=20.0)
    apart = {g.name for g in build_groups(model, [], [])}
    assert {"model.layers.0.mlp.experts.gate_up", "model.layers.0.mlp.experts.down_proj"} <= apart
    whole = {g.name: g for g in build_groups(model, [], [], whole_experts=True)}
    experts = whole["model.layers.0.mlp.experts"]
    assert experts.role == "experts" and not any(".experts." in name for name in whole)
    linears = [model.get_submodule(n) for n in experts.modules]
    count = len(model.model.layers[0].mlp.experts)
    hidden, inter = linears[0].in_features, linears[0].out_features
    assert len(experts.modules) == 3 * count
    # Per expert: gate/up merged, down alone; a dense decode step: every expert's gate/up in one GEMM.
    assert sorted(merged_shapes(experts.modules, linears)) == sorted([(hidden, 2 * inter), (inter, hidden)] * count)
    assert sorted(decode_shapes(experts.modules, linears, "experts", True)) == sorted(
        [(hidden, 2 * inter * count)] + [(inter, hidden)] * count)
    data = blocks(4, 32)
    request = PlanRequest(["w8a8", "w8a16"], force={"*.mlp.gate": "fp32"}, budget_value=0.05, validate=False,
                          compiled_kernels=True)
    doc, _ = make_plan(model, data, collect_stats(model, data), request,
                       WorkloadSpec(batch_size=2, input_len=16, output_len=4))
    planned = {g.name: g.format for g in doc.groups}
    assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= set(planned)
    formats = doc.assignment()
    for layer in (0, 1):  # whatever it chose, one format for all of a layer's experts
        assert len({f for m, f in formats.items() if m.startswith(f"model.layers.{layer}.mlp.experts.")}) == 1
