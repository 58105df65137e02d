"""baseline and eval stages: in-process with a hand-made context, and end to end through ``opus run``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from opus.atomic import write_json
from opus.kv.choice import kv_cache_step
from opus.pipeline.context import StageContext
from opus.pipeline.contracts import UpstreamView
from opus.pipeline.preflight import undeclared_metrics
from opus.pipeline.spec import load_pipeline
from opus.pipeline.state import STATE_FILE, base_state
from opus.runtime.noise import paired_key
from stages import REFERENCE, baseline
from stages import eval as eval_stage

WORDS = [f"w{i}" for i in range(60)]
PIPELINE = """
name: tiny
model:
  hf: model
data:
  evaluation:
    files: ["data/*.txt"]
    samples: 4
    seq_len: 32
workload: {batch_size: 2, input_len: 16, output_len: 4, warmup: 0, repeats: 1}
run: {threads: 1}  # a tiny model on a shared machine: one thread avoids OpenMP barrier stalls
stages:
  - id: baseline
    uses: baseline
    with: {fidelity_prompts: 2, fidelity_prompt_len: 8, fidelity_tokens: 4}
  - id: check
    uses: eval
    needs: baseline
    gate:
      agreement: {min: 0.99}
"""


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A pipeline directory: a tiny random Mixtral saved by transformers, its tokenizer and some text."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.helpers import save_word_tokenizer

    root = tmp_path_factory.mktemp("project")
    vocab_size = save_word_tokenizer(root / "model", WORDS)
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=128)
    MixtralForCausalLM(config).save_pretrained(root / "model")
    (root / "data").mkdir()
    g = torch.Generator().manual_seed(0)
    for part in range(2):
        ids = torch.randint(0, len(WORDS), (150,), generator=g).tolist()
        (root / "data" / f"part{part}.txt").write_text(" ".join(WORDS[i] for i in ids))
    (root / "pipeline.yaml").write_text(PIPELINE)
    return root


def context(project: Path, out: Path, stage_id: str, upstream: dict | None = None,
            incoming: Path | None = None) -> tuple[StageContext, list[str]]:
    loaded = load_pipeline(project / "pipeline.yaml")
    logs: list[str] = []
    ctx = StageContext(run_dir=out.parent, stage_id=stage_id, uses=loaded.spec.stage(stage_id).uses,
                       spec=loaded.spec, base_dir=loaded.base_dir, upstream=upstream or {}, incoming=incoming,
                       out_dir=out, report=lambda m: logs.append(m.get("message", "")))
    return ctx, logs


def test_baseline_then_eval_in_process(project, tmp_path) -> None:
    ctx, _ = context(project, tmp_path / "baseline", "baseline")
    result = baseline.run(ctx, baseline.Config(fidelity_prompts=2, fidelity_prompt_len=8, fidelity_tokens=4))
    assert result.baseline and result.model is None
    assert not undeclared_metrics(baseline, result.metrics)  # what gates are checked against before a run
    for key in ("throughput_tok_s", "ttft_ms", "peak_mem_mb", "perplexity", "top1_accuracy", "decode_tok_s"):
        assert result.metrics[key] > 0, key
    assert result.info["prompt_source"] == "text" and result.info["kv_cache"] == {"kind": "growing"}
    assert result.info["machine"]["cpu"] and "load_after" in result.info["machine"]  # what it was measured on
    reference = tmp_path / "baseline" / "artifacts" / REFERENCE
    assert reference.is_file()

    up = UpstreamView(id="baseline", uses="baseline", key="k", status="done", metrics=result.metrics,
                       dir=tmp_path / "baseline", baseline=True)
    ctx, _ = context(project, tmp_path / "check", "check", upstream={"baseline": up})
    got = eval_stage.run(ctx, eval_stage.Config()).metrics
    assert got["agreement"] == got["agreement_free"] == got["top5_overlap"] == 1.0
    assert not undeclared_metrics(eval_stage, got)
    assert got["logits_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert got["perplexity"] == pytest.approx(result.metrics["perplexity"], rel=1e-6)
    # The same model side by side with the unmodified one: paired rounds, a ratio inside its interval.
    for key in ("throughput_tok_s", "ttft_ms"):
        side = got[paired_key(key)]
        assert side["n"] >= 5 and side["low"] <= side["ratio"] <= side["high"] and side["baseline"] > 0
    alone = eval_stage.run(ctx, eval_stage.Config(side_by_side=False, long_generation_tokens=12,
                                                  long_generation_segment=5))
    assert paired_key("throughput_tok_s") not in alone.metrics
    # The same model generates the same long text: the unmodified model scores both alike, segment by segment.
    assert alone.metrics["long_nll"] == alone.metrics["long_nll_base"] > 0
    assert alone.metrics["long_nll_increase_max"] == 0.0 and not undeclared_metrics(eval_stage, alone.metrics)
    assert [s["tokens"] for s in alone.info["long_generation"]["segments"]] == [[0, 5], [5, 10], [10, 12]]
    # When both would not fit: baseline, candidate, baseline, one at a time, with the drift reported.
    bracketed = eval_stage.run(ctx, eval_stage.Config(side_by_side_mode="bracketed")).metrics
    for key in ("throughput_tok_s", "ttft_ms"):
        side = bracketed[paired_key(key)]
        assert side["method"] == "bracketed" and side["n"] == 2 and isinstance(side["drift"], float)
        assert side["low"] <= side["ratio"] <= side["high"] and side["baseline"] > 0
    assert bracketed["agreement"] == 1.0  # fidelity was measured before the candidate was let go


def test_eval_runs_harness_tasks_on_both_models_over_the_same_samples(project, tmp_path) -> None:
    """A task file beside the pipeline, by path: the candidate (here the same model) and the unmodified one."""
    import yaml

    from opus.pipeline.registry import load_stage_type

    docs = [{"context": " ".join(WORDS[i : i + 6]), "choices": [f" {WORDS[i + 6]}", " w0", " w1"], "label": 0}
            for i in range(2, 40)]
    (project / "tasks").mkdir(exist_ok=True)
    (project / "tasks" / "words.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (project / "tasks" / "words.yaml").write_text(yaml.safe_dump({
        "task": "words", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "words.jsonl"}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "context",
        "doc_to_choice": "choices", "doc_to_target": "label", "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    ctx, _ = context(project, tmp_path / "baseline", "baseline")
    base = baseline.run(ctx, baseline.Config(fidelity_prompts=2, fidelity_prompt_len=8, fidelity_tokens=4))
    up = UpstreamView(id="baseline", uses="baseline", key="k", status="done", metrics=base.metrics,
                      dir=tmp_path / "baseline", baseline=True)
    ctx, logs = context(project, tmp_path / "check", "check", upstream={"baseline": up})
    cfg = eval_stage.Config(side_by_side=False, throughput=False, decode_batch1=False, tasks=["tasks/words.yaml"],
                            task_limit=30)
    got = eval_stage.run(ctx, cfg).metrics
    assert 0 <= got["task/words/acc"] <= 1 and got["task/words/acc"] == got["task/words/acc_base"]
    drop = got["task/words/acc_drop"]
    assert drop["n"] == 30 and drop["drop"] == 0 and drop["worse"] == drop["better"] == 0 and drop["high"] > 0
    assert not undeclared_metrics(eval_stage, got) and any(line.startswith("task/words/acc:") for line in logs)
    # Before anything runs, a task file that is not there names its key.
    problems = load_stage_type("eval").preflight(eval_stage.Config(tasks=["tasks/nope.yaml"]), None, project)
    assert problems and problems[0][0] == ("tasks", "0") and "no such task file" in problems[0][1]


def test_eval_without_a_baseline_skips_fidelity(project, tmp_path) -> None:
    ctx, logs = context(project, tmp_path / "check", "check")
    got = eval_stage.run(ctx, eval_stage.Config(throughput=False, decode_batch1=False)).metrics
    assert "agreement" not in got and "throughput_tok_s" not in got and got["ttft_ms"] > 0
    assert any("no baseline stage upstream" in line for line in logs)


def test_eval_uses_the_kv_cache_the_recipe_chose(project, tmp_path, monkeypatch) -> None:
    (tmp_path / "counting_cache.py").write_text(textwrap.dedent("""
        from opus.kv.cache import GrowingKVCache, register_cache

        built = []

        @register_cache("counting")
        def build(options, shape):
            built.append(shape.batch_size)
            return GrowingKVCache(shape.num_layers)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ctx, _ = context(project, tmp_path / "check", "check")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    state = base_state(ctx.spec)
    state["recipe"] = [kv_cache_step({"kind": "counting", "provider": "counting_cache"}).as_json()]
    write_json(incoming / STATE_FILE, state)
    ctx.incoming = incoming
    result = eval_stage.run(ctx, eval_stage.Config(ttft=False, quality=False))
    import counting_cache

    assert result.info["kv_cache"] == {"kind": "counting", "provider": "counting_cache"}
    assert 2 in counting_cache.built  # the batch workload ran on the recipe's cache


def test_opus_run_end_to_end_then_cached(project, tmp_path) -> None:
    from opus.cli.main import main

    run_dir = tmp_path / "run"
    argv = ["run", str(project / "pipeline.yaml"), "--run-dir", str(run_dir), "--quiet"]
    assert main(argv) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_stage"] == "check"
    for key in ("throughput_tok_s", "ttft_ms", "peak_mem_mb", "perplexity", "top1_accuracy"):
        assert summary["baseline"][key] > 0 and summary["final"][key] > 0, key
    final = summary["final"]
    assert final["agreement"] == final["agreement_free"] == final["top5_overlap"] == 1.0
    assert summary["final"]["logits_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert [s["status"] for s in summary["stages"]] == ["done", "done"]
    # The ratios are the eval stage's side-by-side ones, each with its interval.
    intervals = summary["ratio_intervals"]
    assert set(intervals) == {"throughput_tok_s", "ttft_ms"}
    assert intervals["ttft_ms"]["low"] <= summary["ratios"]["ttft_ms"] <= intervals["ttft_ms"]["high"]

    assert main(argv) == 0
    again = json.loads((run_dir / "summary.json").read_text())
    assert [s["status"] for s in again["stages"]] == ["cached", "cached"]
    assert again["baseline"] == summary["baseline"]
