"""The ``export`` stage and ``opus.export.native``: every target written or reported, and a reloadable native export.

Each target has its own tests in tests/export; here: the stage, the directory they share, and one
target failing without losing the others."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from opus.export.native import export_model, load_exported
from opus.export.settings import ExportSettings
from opus.models import DecoderLM, ModelConfig
from tests.helpers import pipeline, run_cli, statuses, summary, write_pipeline

K3 = Path(__file__).resolve().parents[2] / "examples" / "k3" / "model"
TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8)


def tiny_llama(seed: int = 0) -> DecoderLM:
    """Factory source (``tests.stages.test_export:tiny_llama``)."""
    torch.manual_seed(seed)
    return DecoderLM(ModelConfig(family="llama", **TINY)).eval()


def tiny_mixtral(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(ModelConfig(family="mixtral", num_experts=4, top_k=2, moe_intermediate_size=24, **TINY)).eval()


def _settings(source: dict, **kw) -> ExportSettings:
    return ExportSettings(source=source, base_dir=Path("."), batch_size=2, input_len=8, new_tokens=2, warmup=0,
                          repeats=1, greedy_tokens=3, **kw)


def _assert_parity(metrics: dict) -> None:
    assert metrics["onnx_exported"] == 1
    assert metrics["onnx_max_abs_diff"] < 1e-3
    assert metrics["onnx_next_token_agreement"] == 1.0 and metrics["onnx_greedy_agreement"] == 1.0
    assert metrics["onnx_throughput_tok_s"] > 0 and metrics["onnx_ttft_ms"] > 0


def test_export_stage_end_to_end(tmp_path: Path) -> None:
    from opus.report.document import write_report

    spec = pipeline([{"id": "export", "uses": "export", "with": {"new_tokens": 2, "greedy_tokens": 3}}],
                    model={"factory": "tests.stages.test_export:tiny_llama"},
                    workload={"batch_size": 2, "input_len": 8, "output_len": 2, "warmup": 0, "repeats": 1})
    run_dir = tmp_path / "run"
    assert run_cli("run", write_pipeline(tmp_path / "p.yaml", spec), "--run-dir", run_dir) == 0
    assert statuses(run_dir) == {"export": "done"}
    result = summary(run_dir)
    metrics = result["stages"][0]["metrics"]
    _assert_parity(metrics)
    assert metrics["hf_exported"] == metrics["hf_loads_in_transformers"] == 1  # config.json from the model's config
    assert metrics["hf_next_token_agreement"] == 1.0
    assert metrics["gguf_exported"] == 0  # a factory model without a tokenizer
    # A target it could not write is a warning naming the reason, not a silent "done".
    warnings = result["warnings"]
    assert any(w.startswith("export: gguf not exported (no Hugging Face fast tokenizer") for w in warnings)
    stage_dir = run_dir / "stages" / "00-export"
    info = json.loads((stage_dir / "result.json").read_text())["info"]
    assert "cached greedy loop" in info["targets"]["onnx"]["info"]["onnx_p_method"]
    export_dir = stage_dir / "artifacts" / "export"
    assert (export_dir / "onnx" / "model.onnx").is_file() and not (export_dir / "gguf").exists()
    exports = json.loads((stage_dir / "artifacts" / "exports.json").read_text())
    assert {n: t["exported"] for n, t in exports["targets"].items()} == \
        {"native": True, "hf": True, "gguf": False, "onnx": True}
    write_report(run_dir)
    report = (run_dir / "report.md").read_text()
    assert "## Exports" in report and "no Hugging Face fast tokenizer" in report
    # Reloadable without the run directory.
    moved = shutil.copytree(export_dir, tmp_path / "shipped")
    shutil.rmtree(run_dir)
    reloaded = load_exported(moved, trust_code=True).model  # its factory: this test's own code
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids), tiny_llama()(ids))


def test_moe_export_reloads_changed_weights(tmp_path: Path) -> None:
    model = tiny_mixtral()
    with torch.no_grad():  # what an optimizing stage would have done: the export must carry it
        model.model.layers[0].mlp.experts[1].down_proj.weight.mul_(3.0)
    metrics, info = export_model(model, None, {"recipe": []}, tmp_path / "export",
                                 _settings({"factory": "tests.stages.test_export:tiny_mixtral"}, hf=False, gguf=False))
    _assert_parity(metrics)
    record = json.loads((tmp_path / "export" / "opus-export.json").read_text())
    assert record["onnx"] == "onnx" and record["metrics"]["onnx_exported"] == 1
    assert set(record["info"]["targets"]) == {"native", "onnx"}  # hf and gguf switched off: not attempted
    reloaded = load_exported(tmp_path / "export", trust_code=True).model
    ids = torch.randint(0, TINY["vocab_size"], (1, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))
        assert not torch.equal(reloaded(ids), tiny_mixtral()(ids))


def test_quantized_model_reloads_through_its_recipe(tmp_path: Path) -> None:
    from opus.quant.apply import quantize_model

    model = tiny_llama()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    step = quantize_model(model, {n: "w8a8" if i % 2 else "w8a16" for i, n in enumerate(linears)}, None)
    export_model(model, None, {"recipe": [step]}, tmp_path / "export",
                 _settings({"factory": "tests.stages.test_export:tiny_llama"}, hf=False, gguf=False, onnx=False))
    reloaded = load_exported(tmp_path / "export", trust_code=True).model  # the recipe rebuilds the quantized modules
    assert type(reloaded.model.layers[0].self_attn.q_proj) is type(model.model.layers[0].self_attn.q_proj)
    ids = torch.randint(0, TINY["vocab_size"], (1, 10))
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))


class CustomKernel(nn.Module):
    """Stands in for a quantized module whose kernel has no ONNX translation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tests.export.test_onnx_kv import _no_onnx  # a custom op with no ONNX translation

        return _no_onnx(x)


def test_one_target_failing_loses_none_of_the_others(tmp_path: Path) -> None:
    model = tiny_llama()
    model.model.layers[1].mlp.act = CustomKernel()
    model.model.layers[1].mlp.forward = lambda x, m=model.model.layers[1].mlp: m.down_proj(  # type: ignore
        m.act(m.gate_proj(x)) * m.up_proj(x))
    metrics, info = export_model(model, None, {"recipe": []}, tmp_path / "export",
                                 _settings({"factory": "tests.stages.test_export:tiny_llama"}))
    assert metrics["onnx_exported"] == 0 and "onnx_max_abs_diff" not in metrics
    reason = info["targets"]["onnx"]["reason"]
    assert "opus_test.no_onnx" in reason
    assert not (tmp_path / "export" / "onnx").exists()
    assert (tmp_path / "export" / "tensors.safetensors").is_file()  # the native export still happened
    assert load_exported(tmp_path / "export", trust_code=True).model is not None


def test_non_language_model_is_reported_by_every_target(tmp_path: Path) -> None:
    metrics, info = export_model(nn.Sequential(nn.Linear(4, 2)), None, {"recipe": []}, tmp_path / "export",
                                 _settings({"factory": "tests.fixtures.tiny:tiny_model"}))
    assert metrics["onnx_exported"] == metrics["gguf_exported"] == metrics["hf_exported"] == 0
    assert all(t["reason"] for n, t in info["targets"].items() if n != "native")
    assert (tmp_path / "export" / "tensors.safetensors").is_file()


@pytest.mark.skipif(not K3.is_dir(), reason="examples/k3/model is absent (train it with examples/k3/train.py)")
def test_k3_demo_exports_to_every_target(tmp_path: Path) -> None:
    from opus.models import load_model

    model, tokenizer = load_model({"hf": str(K3)}, ".")
    metrics, info = export_model(model, tokenizer, {"recipe": []}, tmp_path / "export", _settings({"hf": str(K3)}))
    _assert_parity(metrics)
    assert metrics["hf_exported"] == metrics["hf_loads_in_transformers"] == metrics["gguf_exported"] == 1
    assert metrics["hf_next_token_agreement"] == 1.0 and metrics["hf_max_abs_diff"] < 1e-3
    assert info["targets"]["gguf"]["path"] == "gguf/model.gguf"
