"""The ``export`` stage and ``opus.export.native``: ONNX parity in onnxruntime, and a reloadable safetensors export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from opus.export.native import ExportSettings, export_model, load_exported
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
    spec = pipeline([{"id": "export", "uses": "export", "with": {"new_tokens": 2, "greedy_tokens": 3}}],
                    model={"factory": "tests.stages.test_export:tiny_llama"},
                    workload={"batch_size": 2, "input_len": 8, "output_len": 2, "warmup": 0, "repeats": 1})
    run_dir = tmp_path / "run"
    assert run_cli("run", write_pipeline(tmp_path / "p.yaml", spec), "--run-dir", run_dir) == 0
    assert statuses(run_dir) == {"export": "done"}
    _assert_parity(summary(run_dir)["stages"][0]["metrics"])
    result = json.loads((run_dir / "stages" / "00-export" / "result.json").read_text())
    assert "without KV cache" in result["info"]["onnx_p_method"]
    assert result["info"]["onnx_outputs"].startswith("next-token logits")
    export_dir = run_dir / "stages" / "00-export" / "artifacts" / "export"
    assert (export_dir / "model.onnx").is_file() and (export_dir / "tensors.safetensors").is_file()
    # Reloadable without the run directory.
    moved = shutil.copytree(export_dir, tmp_path / "shipped")
    shutil.rmtree(run_dir)
    reloaded = load_exported(moved).model
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids), tiny_llama()(ids))


def test_moe_export_parity_and_reload_of_changed_weights(tmp_path: Path) -> None:
    model = tiny_mixtral()
    with torch.no_grad():  # what an optimizing stage would have done: the export must carry it
        model.model.layers[0].mlp.experts[1].down_proj.weight.mul_(3.0)
    metrics, info = export_model(model, None, {"recipe": []}, tmp_path / "export",
                                 _settings({"factory": "tests.stages.test_export:tiny_mixtral"}))
    _assert_parity(metrics)
    record = json.loads((tmp_path / "export" / "opus-export.json").read_text())
    assert record["onnx"] == "model.onnx" and record["metrics"]["onnx_exported"] == 1
    reloaded = load_exported(tmp_path / "export").model
    ids = torch.randint(0, TINY["vocab_size"], (1, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))
        assert not torch.equal(reloaded(ids), tiny_mixtral()(ids))


def test_int8_quantized_model_exports_with_parity(tmp_path: Path) -> None:
    """W8A8 (``_int_mm``) and W8A16 (``_weight_int8pack_mm``) linears go through Opus's ONNX translations."""
    from opus.quant.apply import quantize_model

    model = tiny_llama()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    step = quantize_model(model, {n: "w8a8" if i % 2 else "w8a16" for i, n in enumerate(linears)}, None)
    metrics, info = export_model(model, None, {"recipe": [step]}, tmp_path / "export",
                                 _settings({"factory": "tests.stages.test_export:tiny_llama"}))
    _assert_parity(metrics)
    assert "onnx_error" not in info
    reloaded = load_exported(tmp_path / "export").model  # the recipe rebuilds the quantized modules
    assert type(reloaded.model.layers[0].self_attn.q_proj) is type(model.model.layers[0].self_attn.q_proj)
    ids = torch.randint(0, TINY["vocab_size"], (1, 10))
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))


def test_quantized_moe_exports_with_parity(tmp_path: Path) -> None:
    """Int8 experts: data-dependent row counts must not become branches in the exported graph."""
    from opus.quant.apply import quantize_model
    from tests.quant.tiny import tiny_decoder

    model = tiny_decoder("mixtral")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".experts." in n]
    step = quantize_model(model, {n: "w8a8" for n in names}, None)
    metrics, info = export_model(model, None, {"recipe": [step]}, tmp_path / "export",
                                 _settings({"factory": "tests.quant.tiny:tiny_decoder", "args": {"family": "mixtral"}}))
    assert "onnx_error" not in info, info.get("onnx_error")
    _assert_parity(metrics)


@torch.library.custom_op("opus_test::unexportable", mutates_args=())
def _unexportable(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_unexportable.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CustomKernel(nn.Module):
    """Stands in for a quantized module whose kernel has no ONNX translation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _unexportable(x)


def test_unexportable_module_is_reported_not_fatal(tmp_path: Path) -> None:
    model = tiny_llama()
    model.model.layers[1].mlp.act = CustomKernel()
    model.model.layers[1].mlp.forward = lambda x, m=model.model.layers[1].mlp: m.down_proj(  # type: ignore
        m.act(m.gate_proj(x)) * m.up_proj(x))
    metrics, info = export_model(model, None, {"recipe": []}, tmp_path / "export",
                                 _settings({"factory": "tests.stages.test_export:tiny_llama"}))
    assert metrics["onnx_exported"] == 0 and "onnx_max_abs_diff" not in metrics
    assert "No ONNX function found" in info["onnx_error"] and "opus_test.unexportable" in info["onnx_error"]
    assert (tmp_path / "export" / "onnx_error.txt").is_file()
    assert not (tmp_path / "export" / "model.onnx").exists()
    assert (tmp_path / "export" / "tensors.safetensors").is_file()  # the safetensors export still happened


def test_non_language_model_is_reported(tmp_path: Path) -> None:
    metrics, info = export_model(nn.Sequential(nn.Linear(4, 2)), None, {"recipe": []}, tmp_path / "export",
                                 _settings({"factory": "tests.fixtures.tiny:tiny_model"}))
    assert metrics["onnx_exported"] == 0 and "no embedding" in info["onnx_error"]


@pytest.mark.skipif(not K3.is_dir(), reason="examples/k3/model is absent (train it with examples/k3/train.py)")
def test_k3_demo_export_parity(tmp_path: Path) -> None:
    from opus.models import load_model

    model, tokenizer = load_model({"hf": str(K3)}, ".")
    metrics, _ = export_model(model, tokenizer, {"recipe": []}, tmp_path / "export", _settings({"hf": str(K3)}))
    _assert_parity(metrics)
