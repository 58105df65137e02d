"""The kv_config stage measures candidates and writes its choice into the recipe; end to end with fuse."""

from __future__ import annotations

import json

import pytest
import torch
from fusion_project import context, make_project

from opus.fusion import GroupedMoE
from opus.kv.cache import make_cache
from opus.kv.choice import cache_config_from_recipe
from opus.models import ModelConfig
from opus.pipeline.preflight import undeclared_metrics
from opus.pipeline.spec import load_pipeline
from opus.pipeline.state import materialize
from opus.runtime.timed_choice import run_relative
from stages import kv_config

SMALL = {"batch_sizes": [1, 2], "input_len": 6, "output_len": 3, "repeats": 1, "warmup": 0,
         "prealloc": [4], "step": [2, 8]}


SHAPE = ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                    num_kv_heads=2, head_dim=8)
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_measures_candidates_and_records_the_decision_at_each_batch_size(tmp_path):
    pipeline = make_project(tmp_path, [{"id": "kv", "uses": "kv_config"}], family="llama")
    result = kv_config.run(context(pipeline, tmp_path / "out", "kv"), kv_config.Config(**{**SMALL, "repeats": 3}))
    assert result.model is None and len(result.recipe) == 1
    step = result.recipe[0]
    chosen = cache_config_from_recipe(result.recipe)
    assert step.kind == "kv_cache" and chosen["kind"] in ("pooled", "growing", "static", "by_batch")
    assert step.sizing.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # layers x KV heads x head dim x fp32
    report = json.loads((tmp_path / "out" / "artifacts" / "kv_config.json").read_text())
    # (2 pooled + growing + static with torch's attention and with the blocked kernels) x 2 batch sizes
    assert len(report["candidates"]) == 5 * 2
    assert all(c["throughput_tok_s"] > 0 for c in report["candidates"])
    recorded = json.loads((tmp_path / "out" / "artifacts" / "decisions.json").read_text())["decisions"]
    decisions = [d for d in recorded if d["what"].startswith("KV cache")]
    assert [d["what"] for d in decisions] == ["KV cache at batch 1", "KV cache at batch 2"]
    for decision in decisions:  # ties on the request's time are settled by the time to first token
        first_token = [d for d in recorded if d["what"].endswith(f"tied {decision['what'][9:]}")]
        assert len(first_token) == (len(decision["tied"]) > 1)
        if first_token:
            assert {c["name"] for c in first_token[0]["candidates"]} == set(decision["tied"])
            assert decision["winner"] == first_token[0]["winner"]
    for batch, decision in zip((1, 2), decisions):  # the recipe's cache at each batch size is the decision's
        rows = {c["label"]: c for c in report["candidates"] if c["batch_size"] == batch}
        assert {c["name"] for c in decision["candidates"]} == set(rows)
        assert {len(c["rounds"]) for c in decision["candidates"]} in ({3}, {6})  # 6: measured once more (choose)
        assert decision["winner"] in decision["tied"]
        won = rows[decision["winner"]]["cache"]
        assert report["winners"][str(batch)] == won
        assert type(make_cache(chosen, SHAPE, batch, 16)) is type(make_cache(won, SHAPE, batch, 16))
    assert result.metrics["kv_exact_match"] == 1.0 and result.metrics["kv_max_batch"] >= 2
    assert not undeclared_metrics(kv_config, result.metrics)  # what gates are checked against before a run


def test_a_tie_on_the_request_goes_to_the_shorter_time_to_first_token():
    from opus.runtime.timed_choice import Option, decide_from

    # Equally fast requests (within the noise), but one prefills in 15 ms against 20: that one serves.
    options = [Option("eager prefill", simplicity=2), Option("compiled prefill", simplicity=3)]
    request = decide_from("KV cache at batch 1", options, {"eager prefill": [0.100, 0.101, 0.100],
                                                           "compiled prefill": [0.100, 0.100, 0.101]})
    assert set(request.tied) == {"eager prefill", "compiled prefill"}
    assert request.winner == "eager prefill"  # the simpler, before the first token is asked
    first_token = kv_config._first_token_among_tied(request, options, {"eager prefill": [0.020, 0.020, 0.021],
                                                                       "compiled prefill": [0.015, 0.015, 0.016]})
    assert first_token.what == "time to first token, among the KV caches tied at batch 1"
    assert request.winner == first_token.winner == "compiled prefill"
    assert request.reason == ("fastest; of the 2 tied within the 2.0% noise margin, the shortest time to first "
                              "token (15.00 against 20.00 ms for the simpler eager prefill)")
    # Prefills within the noise of each other as well: the simpler keeps it.
    request = decide_from("KV cache at batch 1", options, {"eager prefill": [0.100, 0.101, 0.100],
                                                           "compiled prefill": [0.100, 0.100, 0.101]})
    kv_config._first_token_among_tied(request, options, {"eager prefill": [0.020, 0.020, 0.020],
                                                         "compiled prefill": [0.0199, 0.0200, 0.0200]})
    assert request.winner == "eager prefill" and "first token" not in request.reason


def test_a_prefill_faster_in_every_round_wins_a_tie_that_drift_made():
    from opus.runtime.timed_choice import Option, decide_from

    # The machine slowed down after the second round: every cache's spread, and so the margin, grew wide,
    # yet the compiled prefill was the shorter in every round (as in a K3 demo on a 2-core EPYC).
    options = [Option("eager prefill", simplicity=2), Option("compiled prefill", simplicity=3)]
    request = decide_from("KV cache at batch 1", options, {"eager prefill": [0.10, 0.10, 0.12, 0.12, 0.12],
                                                           "compiled prefill": [0.10, 0.10, 0.12, 0.12, 0.12]})
    first_token = kv_config._first_token_among_tied(
        request, options, {"eager prefill": [0.012, 0.012, 0.0165, 0.0165, 0.016],
                           "compiled prefill": [0.010, 0.0105, 0.014, 0.0145, 0.0138]})
    assert first_token.margin > 0.16  # the medians (16.0 against 13.8 ms) are within it
    assert request.winner == first_token.winner == "compiled prefill"
    assert first_token.reason.endswith("; but compiled prefill prefilled faster than eager prefill in every one of "
                                       "the 5 rounds (median ratio ×0.862), so it serves")
    assert request.reason == ("fastest; of the 2 tied within the 16.7% noise margin, a shorter time to first token "
                              "in every round (13.80 against 16.00 ms for the simpler eager prefill)")
    # Faster in four rounds of five: within the noise, the simpler keeps it.
    request = decide_from("KV cache at batch 1", options, {"eager prefill": [0.10] * 5, "compiled prefill": [0.10] * 5})
    kv_config._first_token_among_tied(request, options, {"eager prefill": [0.012, 0.012, 0.0165, 0.0165, 0.016],
                                                         "compiled prefill": [0.010, 0.0105, 0.014, 0.0145, 0.0166]})
    assert request.winner == "eager prefill"


def test_an_earlier_runs_caches_are_replayed(tmp_path):
    pipeline = make_project(tmp_path, [{"id": "kv", "uses": "kv_config"}], family="llama")
    earlier = tmp_path / "earlier" / "artifacts" / "kv"
    earlier.mkdir(parents=True)
    growing, pooled = {"kind": "growing"}, {"kind": "pooled", "provider": "opus.kv.pool", "prealloc": 4, "step": 2,
                                             "max_context": 8192}
    sizing = {"kv_bytes_per_token": 128, "memory_budget_mb": 64.0, "context": 12, "max_context": 8192,
              "max_batch": 99, "batch_size": 2}
    (earlier / "kv_config.json").write_text(json.dumps({"chosen": growing, "sizing": sizing,
                                                        "winners": {"1": growing, "2": pooled}}))
    ctx = context(pipeline, tmp_path / "out", "kv")
    ctx.spec.run.decisions_from = str(tmp_path / "earlier")
    result = kv_config.run(ctx, kv_config.Config(**SMALL))
    report = json.loads((tmp_path / "out" / "artifacts" / "kv_config.json").read_text())
    assert [(c["batch_size"], c["cache"]) for c in report["candidates"]] == [(1, growing), (2, pooled)]
    assert report["winners"] == {"1": growing, "2": pooled}  # the earlier choice, not this run's timings
    assert cache_config_from_recipe(result.recipe)["kind"] == "by_batch"
    decisions = json.loads((tmp_path / "out" / "artifacts" / "decisions.json").read_text())["decisions"]
    assert all(d["replayed_from"] == run_relative(str(earlier / "kv_config.json")) for d in decisions)


def test_an_earlier_report_that_is_not_one_is_named_in_one_line(tmp_path):
    """run.decisions_from replays kv_config.json through its typed document: a field missing or mistyped
    is the file and the field, never a KeyError mid-stage."""
    from opus.errors import InputError

    pipeline = make_project(tmp_path, [{"id": "kv", "uses": "kv_config"}], family="llama")
    earlier = tmp_path / "earlier" / "artifacts" / "kv"
    earlier.mkdir(parents=True)
    (earlier / "kv_config.json").write_text(json.dumps({"winners": {"1": {"kind": "growing"}}}))
    ctx = context(pipeline, tmp_path / "out", "kv")
    ctx.spec.run.decisions_from = str(tmp_path / "earlier")
    with pytest.raises(InputError, match=r"kv_config.json: chosen: Field required"):
        kv_config.run(ctx, kv_config.Config(**SMALL))


def test_budget_limits_the_batch(tmp_path):
    pipeline = make_project(tmp_path, [{"id": "kv", "uses": "kv_config"}], family="llama")
    per_token = 2 * 2 * 2 * 8 * 4
    cfg = kv_config.Config(**{**SMALL, "memory_budget_mb": per_token * 12 * 1.5 / (1 << 20)})  # ~1.5 sequences
    result = kv_config.run(context(pipeline, tmp_path / "out", "kv"), cfg)
    report = json.loads((tmp_path / "out" / "artifacts" / "kv_config.json").read_text())
    skipped = [c for c in report["candidates"] if "skipped" in c]
    assert all("does not fit" in c["skipped"] for c in skipped)
    assert [c for c in report["candidates"] if c["batch_size"] == 2] == [c for c in skipped if c["batch_size"] == 2]
    assert result.metrics["kv_batch_size"] == 1


def test_fuse_then_kv_config_then_eval_through_the_runner(tmp_path):
    from opus.cli.main import main

    stages = [
        {"id": "fuse", "uses": "fuse", "with": {"measure_time": False, "experts": {"choose": False}},
         "gate": {"fusion_exact_match": {"min": 0.95}}},
        {"id": "kv", "uses": "kv_config", "needs": "fuse", "with": SMALL},
        {"id": "check", "uses": "eval", "needs": "kv", "with": {"quality": False}},
    ]
    pipeline = make_project(tmp_path, stages, family="mixtral")
    run_dir = tmp_path / "run"
    argv = ["run", str(pipeline), "--run-dir", str(run_dir), "--quiet"]
    assert main(argv) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["done", "done", "done"], summary
    final = sorted((run_dir / "stages").glob("*-check"))[0]
    state = json.loads((final / "state.json").read_text())
    assert [s["kind"] for s in state["recipe"]] == ["fuse", "kv_cache"]  # the kv step rode along unchanged tensors
    loaded = load_pipeline(pipeline)
    model = materialize(final, loaded.spec, loaded.base_dir).model  # rebuilt from recipe + tensors
    assert isinstance(model.model.layers[0].mlp, GroupedMoE)
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(model.named_parameters())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    check_done = next(e for e in events if e.get("event") == "stage_done" and e.get("stage") == "check")
    assert check_done["metrics"]["throughput_tok_s"] > 0

    assert main(argv) == 0  # resume: every stage's checkpoint is reused
    again = json.loads((run_dir / "summary.json").read_text())
    assert [s["status"] for s in again["stages"]] == ["cached", "cached", "cached"]


def test_the_cuda_graph_kind_is_a_candidate_uncaptured_on_cpu_or_skipped_with_the_reason(tmp_path):
    """Candidates come from the registry: on CPU the CUDA-graph kind is listed unavailable with why, by
    default, and measured (its step uncaptured) against the others with ``cuda_graph: true``."""
    pipeline = make_project(tmp_path, [{"id": "kv", "uses": "kv_config"}], family="llama")
    logs: list[str] = []
    ctx = context(pipeline, tmp_path / "default", "kv")
    ctx.log = logs.append  # type: ignore[method-assign]
    kv_config.run(ctx, kv_config.Config(**SMALL))
    report = json.loads((tmp_path / "default" / "artifacts" / "kv_config.json").read_text())
    assert [u["cache"]["kind"] for u in report["unavailable"]] == ["cuda_graph"]
    assert "CUDA graphs need a CUDA device" in report["unavailable"][0]["skipped"]
    assert any("cuda_graph" in line and "skipped" in line for line in logs)  # never silently
    assert "cuda_graph" not in {c["cache"]["kind"] for c in report["candidates"]}

    result = kv_config.run(context(pipeline, tmp_path / "cpu", "kv"), kv_config.Config(**SMALL, cuda_graph=True))
    report = json.loads((tmp_path / "cpu" / "artifacts" / "kv_config.json").read_text())
    assert report["unavailable"] == []
    graph_rows = [c for c in report["candidates"] if c["cache"]["kind"] == "cuda_graph"]
    assert [r["batch_size"] for r in graph_rows] == [1, 2] and all(r["throughput_tok_s"] > 0 for r in graph_rows)
    assert graph_rows[0]["cache"]["capture"] is False  # the same step, uncaptured
    decisions = json.loads((tmp_path / "cpu" / "artifacts" / "decisions.json").read_text())["decisions"]
    races = [d for d in decisions if d["what"].startswith("KV cache")]  # not the first-token ones among the tied
    assert len(races) == 2 and all(any(c["name"] == graph_rows[0]["label"] for c in d["candidates"]) for d in races)
    assert result.metrics["kv_exact_match"] == 1.0  # whichever won computes the growing cache's tokens


def test_a_lossy_cache_races_only_within_its_perplexity_limit(tmp_path, monkeypatch):
    from opus.runtime import kv_fidelity as fidelity

    pipeline = make_project(tmp_path, [{"id": "kv", "uses": "kv_config"}], family="llama")
    narrow = {**SMALL, "batch_sizes": [2], "static_attention": ["sdpa"], "static_kv_dtypes": [None, "bfloat16"]}
    kv_config.run(context(pipeline, tmp_path / "a", "kv"), kv_config.Config(**narrow))
    report = json.loads((tmp_path / "a" / "artifacts" / "kv_config.json").read_text())
    labels = [c["label"] for c in report["candidates"]]
    assert "static compile True, slot_multiple 128, kv_dtype bfloat16" in labels  # measured, then raced
    [figures] = report["kv_fidelity"].values()
    assert abs(figures["increase"]) < 0.005 and figures["text"] in ("evaluation text", "random token ids")

    real, lossy_runs = fidelity.ppl_through_cache, []  # a cache made 3 % worse: refused before any race

    def worse(m, b, c):
        lossy_runs.extend([c] if c and c.get("kv_dtype") else [])
        return real(m, b, c) * (1.03 if c and c.get("kv_dtype") else 1.0)

    monkeypatch.setattr(fidelity, "ppl_through_cache", worse)
    two_kernels = {**narrow, "static_attention": ["sdpa", "blocked"]}  # two bf16 caches, one dtype
    result = kv_config.run(context(pipeline, tmp_path / "b", "kv"), kv_config.Config(**two_kernels))
    report = json.loads((tmp_path / "b" / "artifacts" / "kv_config.json").read_text())
    assert all("kv_dtype" not in c["cache"] for c in report["candidates"])
    refused = [u for u in report["unavailable"] if "kv_dtype" in u["cache"]]
    assert len(refused) == 2 and all("beyond max_kv_ppl_increase 0.500%" in r["skipped"] for r in refused)
    # Measured once for the dtype, through eager steps (no graph compiled for it), the figure shared.
    assert len(lossy_runs) == 1 and lossy_runs[0]["compile"] is False
    first, second = report["kv_fidelity"].values()
    assert first == second and "compile False" in first["measured_with"]
    assert result.metrics["kv_ppl_increase"] == 0.0  # nothing chosen keeps K/V narrower


def test_the_bf16_attention_races_only_within_its_prefill_perplexity_limit(tmp_path, monkeypatch):
    from opus.models import native_attention
    from opus.runtime import kv_fidelity as fidelity

    model = {"factory": "fusion_kit:tiny_lm", "args": {"family": "llama", "head_dim": 32}}
    pipeline = make_project(tmp_path, [{"id": "kv", "uses": "kv_config"}], model=model)
    settings = {**SMALL, "batch_sizes": [2], "include_growing": False, "static_attention": ["blocked", "blocked_bf16"]}
    real, measured = fidelity.ppl_of_prefill, []

    def worse(m, b, c):  # the bf16 prefill made 3 % worse: refused before any race
        measured.append((c, b.shape))
        return real(m, b, c) * (1.03 if c else 1.0)

    monkeypatch.setattr(fidelity, "ppl_of_prefill", worse)
    result = kv_config.run(context(pipeline, tmp_path / "a", "kv"), kv_config.Config(**settings))
    report = json.loads((tmp_path / "a" / "artifacts" / "kv_config.json").read_text())
    assert [c["cache"].get("attention") for c in report["candidates"] if c["cache"]["kind"] == "static"] == ["blocked"]
    [refused] = [u for u in report["unavailable"] if u["cache"].get("attention") == "blocked_bf16"]
    if (why := native_attention.bf16_reason(torch.float32, "cpu", 32)) is not None:  # this CPU cannot run it
        assert refused["skipped"] == why and measured == []
        return
    assert "beyond max_kv_ppl_increase 0.500%" in refused["skipped"]
    # Measured once, through the eager prefill (no graph compiled for it), on blocks as long as the model's
    # 256 positions allow (random ids: this project has no evaluation text), against the model's own attention.
    assert [(c and c["compile"], shape) for c, shape in measured] == [(None, (8, 256)), (False, (8, 256))]
    [figures] = report["kv_fidelity"].values()
    assert figures["increase"] == pytest.approx(0.03, abs=0.01) and figures["text"] == "random token ids"
    assert "attention blocked_bf16" in figures["measured_with"]
    assert result.metrics["kv_ppl_increase"] == 0.0  # nothing chosen is lossy


def test_a_packed_gemm_per_phase_is_accepted_and_a_wrong_one_is_named():
    """W8A8's ``w8a8_packed_gemm`` choice takes phases (oneDNN's kernel) or a kernel per phase; anything else
    is one message saying what may be written; a choice no format declares names those there are."""
    from pydantic import ValidationError

    raced = [None, "both", {"prefill": "onednn", "decode": "fbgemm"}]
    ok = kv_config.Config(kernel_choices={"w8a8_packed_gemm": raced})
    assert ok.kernel_choices["w8a8_packed_gemm"][2] == {"prefill": "onednn", "decode": "fbgemm"}
    for wrong in ("sometimes", {"decode": "mkl"}, {"warmup": "fbgemm"}, {}):
        with pytest.raises(ValidationError, match="a kernel per phase .* fbgemm, onednn"):
            kv_config.Config(kernel_choices={"w8a8_packed_gemm": [wrong]})
    with pytest.raises(ValidationError, match="no kernel choice 'w8a8_packed_gem' .*w8a8_weight_only_rows"):
        kv_config.Config(kernel_choices={"w8a8_packed_gem": [None]})
    with pytest.raises(ValidationError, match="w8a8_weight_only_rows must be a number of rows"):
        kv_config.Config(kernel_choices={"w8a8_weight_only_rows": [-1]})


def test_kernel_choices_as_written_before_they_moved_onto_the_formats_still_run():
    """A pipeline file of before (``static_w8a8_packed_gemm: [...]``) means the same choices; both spellings
    of one choice at once is one line."""
    from pydantic import ValidationError

    old = kv_config.Config(static_w8a8_packed_gemm=[None, "prefill"], static_w8a8_weight_only_rows=[1])
    assert old.kernel_choices == {"w8a8_packed_gemm": [None, "prefill"], "w8a8_weight_only_rows": [1]}
    with pytest.raises(ValidationError, match="static_w8a8_packed_gemm and kernel_choices.w8a8_packed_gemm"):
        kv_config.Config(static_w8a8_packed_gemm=[None], kernel_choices={"w8a8_packed_gemm": ["both"]})
