"""``opus bench`` on a tiny model: the table's rows, ratios, reasons, and the md/json/png outputs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opus.bench import hf_contender, llamacpp, torch_contenders
from opus.bench.core import Row, Unavailable, judge
from opus.bench.run import all_contenders, select
from opus.bench.target import pipeline_budget
from opus.cli.main import main
from opus.errors import InputError
from opus.pipeline.spec import load_pipeline
from tests.bench.project import kv_only_run, make_project

EVERY = ["fp32", "bf16", "torch-int8", "w8a16", "w4a16", "w8a8", "w8a8-tensor", "compile", "hf", "onnx-fp32",
         "onnx-int8", "ov", "ov-int8", "ov-fp32", "llama-f16", "llama-q8_0", "llama-q4_0", "llama-plan", "opus"]
SPEED = ("throughput_tok_s", "ttft_ms", "decode_tok_s", "peak_mem_mb", "perplexity")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("bench"))


def _bench(*args: str) -> int:
    return main(["bench", *map(str, args), "--quiet", "--group-size", "32"])


def test_every_contender_gets_a_row(pipeline, tmp_path, monkeypatch, capsys) -> None:
    # What this machine may or may not have is made explicit: no C++ compiler, no llama-cpp-python.
    monkeypatch.setattr(torch_contenders, "find_cxx", lambda: None)

    def no_llama() -> None:
        raise Unavailable(llamacpp.INSTALL_HINT)

    monkeypatch.setattr(llamacpp, "_require_llama", no_llama)
    out = tmp_path / "out"
    assert _bench(pipeline, "--runs-dir", tmp_path / "runs", "--out", out, "--format", "json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert (out / "bench.md").is_file() and (out / "bench.png").stat().st_size > 1000
    report = json.loads((out / "bench.json").read_text())
    assert report == printed
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == EVERY
    base = rows["fp32"]
    assert base["status"] == "ok" and base["verdict"] == "within"
    assert all(v == pytest.approx(1.0) for v in base["ratios"].values())
    assert set(base["ratios"]) >= {"throughput_tok_s", "ttft_ms", "decode_tok_s", "peak_mem_mb", "perplexity"}
    assert base["metrics"]["agreement"] == 1.0
    assert report["budget"] == {"value": 0.05, "source": "stage 'check' gate perplexity.max_increase"}
    assert report["machine"]["cpu"] and "load_after" in report["machine"]  # what the figures were measured on
    for name in ("bf16", "torch-int8", "w8a16", "w4a16", "w8a8", "w8a8-tensor", "hf", "onnx-fp32", "onnx-int8",
                 "ov", "ov-fp32", "ov-int8"):
        row = rows[name]
        assert row["status"] == "ok", (name, row["reason"])
        assert row["metrics"]["throughput_tok_s"] > 0 and row["metrics"]["perplexity"] > 0
        assert all(math.isfinite(row["metrics"][key]) for key in SPEED), name
        assert 0 <= row["metrics"]["agreement"] <= 1 and row["verdict"] in ("within", "over")
    # transformers' own model on the same weights: the same perplexity and tokens as Opus's fp32 decoder.
    assert rows["hf"]["ratios"]["perplexity"] == pytest.approx(1.0, abs=1e-4)
    assert rows["hf"]["metrics"]["agreement"] == 1.0 and "DynamicCache" in rows["hf"]["notes"][0]
    # SmoothQuant calibrates as the plan stage does (no data.calibration here: the evaluation text);
    # the naive per-tensor format is not smoothed.
    assert any("calibrated on 2 blocks × 16 tokens of data.evaluation" in n for n in rows["w8a8"]["notes"])
    assert any(n.startswith("SmoothQuant on") for n in rows["w8a8"]["notes"])
    assert any("no smoothing" in n for n in rows["w8a8-tensor"]["notes"])
    # The exported fp32 graph computes what the fp32 model does.
    assert rows["onnx-fp32"]["ratios"]["perplexity"] == pytest.approx(1.0, abs=1e-4)
    assert rows["onnx-fp32"]["metrics"]["agreement"] == 1.0
    assert any("without a KV cache" in note for note in rows["onnx-fp32"]["notes"])
    # OpenVINO on the exported KV-cache graph, its state kept in the infer request: the fp32 model's figures.
    assert rows["ov-fp32"]["ratios"]["perplexity"] == pytest.approx(1.0, abs=1e-4)
    assert rows["ov-fp32"]["metrics"]["agreement"] == 1.0
    assert rows["ov-int8"]["metrics"]["model_mb"] < 0.5 * rows["ov-fp32"]["metrics"]["model_mb"]
    assert "C++ compiler" in rows["compile"]["reason"]
    assert all("llama-cpp-python is not installed" in rows[n]["reason"] for n in ("llama-f16", "llama-q8_0",
                                                                                    "llama-q4_0", "llama-plan"))
    assert "no finished run of pipeline 'tinybench'" in rows["opus"]["reason"]
    markdown = (out / "bench.md").read_text()
    assert "| fp32 |" in markdown and "skipped: llama-cpp-python is not installed" in markdown


def test_a_run_directory_benches_its_final_model(pipeline, tmp_path, capsys) -> None:
    run = kv_only_run(pipeline, tmp_path / "runs" / "tinybench-1")
    assert _bench(run, "--only", "opus", "--format", "json", "--budget", "0") == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert list(rows) == ["fp32", "opus"]
    opus = rows["opus"]
    assert opus["status"] == "ok" and "recipe: kv_cache" in opus["notes"][0]
    # The same weights through the same engine: the same perplexity and tokens.
    assert opus["ratios"]["perplexity"] == pytest.approx(1.0) and opus["metrics"]["agreement"] == 1.0
    assert opus["verdict"] == "within"
    # A pipeline finds the same run as its latest finished one.
    assert _bench(pipeline, "--runs-dir", tmp_path / "runs", "--only", "opus", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["run"] == str(run)


def test_selection_and_budget(pipeline) -> None:
    contenders = all_contenders(user_gguf=False)
    names = [c.name for c in select(contenders, ["llama", "w4a16"])]
    assert names == ["fp32", "w4a16", "llama-f16", "llama-q8_0", "llama-q4_0", "llama-plan"]
    assert [c.name for c in select(contenders, ["onnxruntime"])] == ["fp32", "onnx-fp32", "onnx-int8"]
    # What replaced bench/demo.py: `opus bench PIPELINE --only hf,fp32,bf16`.
    assert [c.name for c in select(contenders, ["hf", "fp32", "bf16"])] == ["fp32", "bf16", "hf"]
    assert [c.name for c in select(contenders, ["w8a8"])] == ["fp32", "w8a8", "w8a8-tensor"]  # a prefix, like llama
    assert [c.name for c in all_contenders(user_gguf=True) if c.family == "llama.cpp"] == [
        "llama-gguf", "llama-q8_0", "llama-q4_k_m", "llama-plan"]
    with pytest.raises(InputError, match="unknown contender 'tensorrt'"):
        select(contenders, ["tensorrt"])
    assert pipeline_budget(load_pipeline(pipeline)) == (0.05, "stage 'check' gate perplexity.max_increase")


def test_verdict_against_the_budget() -> None:
    rows = [Row("fp32", "", "torch", metrics={"perplexity": 10.0, "throughput_tok_s": 100.0}),
            Row("a", "", "torch", metrics={"perplexity": 10.05, "throughput_tok_s": 150.0}),
            Row("b", "", "torch", metrics={"perplexity": 10.2}),
            Row("c", "", "torch", status="skipped", reason="no GPU")]
    judge(rows, 0.01)
    assert [r.verdict for r in rows] == ["within", "within", "over", "n/a"]
    assert rows[1].ratios["throughput_tok_s"] == pytest.approx(1.5)
    assert rows[2].ppl_increase == pytest.approx(0.02)


def test_unavailable_contenders_say_why(pipeline) -> None:
    """hf needs a Hugging Face directory or a GGUF file; SmoothQuant W8A8 needs text to calibrate on."""
    ctx = SimpleNamespace(source={"factory": "pkg.mod:fn"}, base_dir=pipeline.parent, device="cpu")
    with pytest.raises(Unavailable, match="a factory source, not a Hugging Face directory"):
        hf_contender.hf(ctx)
    ctx = SimpleNamespace(source={"gguf": "model.gguf"}, base_dir=pipeline.parent, device="cpu")
    with pytest.raises(Unavailable, match="no GGUF file .*model.gguf for transformers to load"):
        hf_contender.hf(ctx)
    spec = load_pipeline(pipeline).spec
    no_text = spec.model_copy(update={"data": spec.data.model_copy(update={"evaluation": None})})
    ctx = SimpleNamespace(spec=no_text, shared={})
    with pytest.raises(Unavailable, match="no data.calibration or data.evaluation"):
        torch_contenders.calibration(ctx, torch.nn.Linear(8, 8))


def test_planned_mix_script_adds_the_plan_to_the_bench(pipeline, tmp_path, capsys) -> None:
    """bench/planned_mix.py: the planner's mix, made as the plan and quantize stages make it, as one more
    contender of the same bench (the plan stage's defaults here: the tiny pipeline has no plan stage)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "planned_mix.py"
    module_spec = importlib.util.spec_from_file_location("planned_mix", path)
    script = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(script)
    out = tmp_path / "out"
    assert script.main([str(pipeline), "--only", "w8a8", "--format", "json", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert list(rows) == ["fp32", "w8a8", "w8a8-tensor", "plan"]
    plan = rows["plan"]
    assert plan["status"] == "ok", plan["reason"]
    assert all(math.isfinite(plan["metrics"][key]) for key in SPEED)
    assert "no plan stage in the pipeline: its defaults" in plan["notes"][0]
    assert (out / "plan.yaml").is_file() and (out / "bench.md").is_file()
