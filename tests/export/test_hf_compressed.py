"""The Hugging Face export (compressed-tensors): transformers loads it and computes what Opus computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from opus.export.hf_compressed import export_hf
from opus.export.settings import ExportSettings
from opus.fusion import FusionConfig, fuse_model, lm_probe
from opus.models import load_model
from opus.quant.apply import quantize_model
from opus.quant.calibrate import collect_stats

K3 = Path(__file__).resolve().parents[2] / "examples" / "k3" / "model"


def _settings(source: dict) -> ExportSettings:
    return ExportSettings(source=source, base_dir=Path("."), prompts=["def main():\n", "import os\nimport sys\n",
                                                                      "The quick brown fox"])


def _tiny_llama(tmp_path: Path, tie: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    return tmp_path / "src"


def _linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("mlp.gate")]


@torch.no_grad()
def test_k3_mixed_plan_fused_loads_in_transformers_with_the_same_next_tokens(tmp_path: Path) -> None:
    model, tokenizer = load_model({"hf": str(K3)}, Path("."))
    ids = torch.tensor([tokenizer.encode("def main():\n    return 42\n")])
    plan = {n: "w8a8" if "self_attn" in n else "w4a16" if "experts" in n else "w8a16" for n in _linears(model)}
    quantize_model(model, plan, collect_stats(model, ids), group_size=64)
    model = fuse_model(model, FusionConfig(), lm_probe(ids)).model
    outcome = export_hf(model, tokenizer, {}, tmp_path, _settings({"hf": str(K3)}))
    assert outcome.exported and outcome.path == "hf", outcome.reason
    assert outcome.metrics["hf_loads_in_transformers"] == 1, outcome.info.get("transformers_error")
    # Every position of the prompts, against Opus as it runs: its W8A16 GEMMs take bf16 activations, and the
    # w4a16 experts' asymmetric groups are stored symmetric (below), so not every greedy token is the same.
    assert outcome.metrics["hf_compared_positions"] == sum(len(tokenizer.encode(p)) for p in _settings({}).prompts)
    assert outcome.metrics["hf_logits_cosine"] > 0.999 and outcome.metrics["hf_next_token_agreement"] >= 0.85
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the quantized lm_head no longer shares the embedding
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mixed-precision"
    targets = {t for g in q["config_groups"].values() for t in g["targets"]}
    assert "model.layers.0.self_attn.q_proj" in targets and "lm_head" in targets
    # The experts as transformers 5.x has them: one fused module per MoE layer (no "Could not match" per expert).
    assert r"re:^model\.layers\.(0|1|2|3)\.mlp\.experts$" in targets
    assert not any("block_sparse_moe.experts" in t for t in targets)
    assert q["ignore"] == [f"model.layers.{i}.block_sparse_moe.gate" for i in range(4)]  # the routers stay float
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    # The w4a16 experts were requantized (symmetric groups); int8 layers hold Opus's integers.
    assert len(outcome.layers_not_as_planned) == 4 * 8 * 3
    assert all("requantized" in why and "one scheme" not in why for why in outcome.layers_not_as_planned.values())


@pytest.mark.parametrize("experts", ["w8a8 and w8a16", "float"])
@torch.no_grad()
def test_experts_in_several_formats_or_float_load_right_in_transformers(tmp_path: Path, experts: str) -> None:
    """transformers 5.x dequantizes all of a model's experts with one scheme: experts planned in two formats
    came out as garbage (agreement 0.002 on this text), float experts in a quantized model failed the load.
    They are stored in one 8-bit scheme, each named in layers_not_as_planned."""
    model, tokenizer = load_model({"hf": str(K3)}, Path("."))
    names = _linears(model)
    if experts == "float":
        plan = {n: "w8a16" for n in names if ".experts." not in n}
    else:
        plan = {n: ["w8a8", "w8a16"][i % 2] for i, n in enumerate(names)}
    quantize_model(model, plan, None)
    settings = _settings({"hf": str(K3)})
    held_out = sorted((K3.parent / "data" / "heldout").glob("*.txt"))[:4]
    settings.held_out = [torch.tensor([tokenizer.encode(f.read_text())[:128]]) for f in held_out]
    outcome = export_hf(model, tokenizer, {}, tmp_path, settings)
    assert outcome.metrics["hf_loads_in_transformers"] == 1, outcome.info.get("transformers_error")
    assert outcome.metrics["hf_compared_positions"] == sum(ids.numel() for ids in settings.held_out) > 400
    assert outcome.metrics["hf_next_token_agreement"] >= 0.97 and outcome.metrics["hf_logits_cosine"] > 0.999
    groups = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]["config_groups"]
    expert_groups = [g for g in groups.values() if any("experts" in t for t in g["targets"])]
    assert len(expert_groups) == 1 and expert_groups[0]["weights"]["strategy"] == "group"
    notes = outcome.layers_not_as_planned
    assert len(notes) == 4 * 8 * 3 and all("experts' one scheme" in why for why in notes.values())


@torch.no_grad()
def test_int8_layers_hold_exactly_the_integers_opus_runs(tmp_path: Path) -> None:
    source = _tiny_llama(tmp_path, tie=True)
    model, _ = load_model({"hf": str(source)}, Path("."))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, {n: "w8a8" for n in _linears(model) if n != "lm_head"}, collect_stats(model, ids))
    q_rows = model.model.layers[0].self_attn.q_proj.qweight.clone()
    k_rows = model.model.layers[0].self_attn.k_proj.qweight.clone()
    model = fuse_model(model, FusionConfig(), lm_probe(ids)).model  # q/k/v become one layer
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")
    outcome = export_hf(model, None, {}, tmp_path / "x", _settings({"hf": str(source)}))
    assert outcome.exported and outcome.layers_not_as_planned == {}
    assert outcome.metrics["hf_loads_in_transformers"] == 1 and outcome.metrics["hf_next_token_agreement"] == 1.0
    with safe_open(str(tmp_path / "x" / "hf" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), q_rows)
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.k_proj.weight"), k_rows)
        assert "lm_head.weight" not in f.keys()  # float and tied: transformers ties it again
    config = json.loads((tmp_path / "x" / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    group = next(iter(config["quantization_config"]["config_groups"].values()))
    assert group["format"] == "int-quantized" and group["input_activations"]["strategy"] == "token"


@torch.no_grad()
def test_float_model_exports_without_quantization_config_and_matches(tmp_path: Path) -> None:
    source = _tiny_llama(tmp_path, tie=False)
    model, _ = load_model({"hf": str(source)}, Path("."))
    outcome = export_hf(model, None, {}, tmp_path / "x", _settings({"hf": str(source)}))
    assert outcome.exported and outcome.metrics["hf_max_abs_diff"] < 1e-4
    assert "quantization_config" not in json.loads((tmp_path / "x" / "hf" / "config.json").read_text())


@pytest.mark.parametrize("source", [{"gguf": "model.gguf"}, {"factory": "tests.quant.tiny:tiny_decoder"}])
@torch.no_grad()
def test_a_source_without_config_json_gets_one_from_the_model_config(tmp_path: Path, source: dict) -> None:
    from tests.quant.tiny import tiny_decoder

    model = tiny_decoder("qwen2_moe")  # shared expert and its gate: every part of a MoE layer
    quantize_model(model, {n: "w8a16" for n in _linears(model) if not n.endswith("shared_expert_gate")}, None)
    outcome = export_hf(model, None, {}, tmp_path, _settings(source))
    assert outcome.exported and outcome.metrics["hf_loads_in_transformers"] == 1, outcome.info
    # Random weights, every prompt position: near-ties that W8A16's bf16 activations may flip.
    assert outcome.metrics["hf_logits_cosine"] > 0.9999 and outcome.metrics["hf_next_token_agreement"] >= 0.95
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]


@pytest.mark.parametrize("family", ["mixtral", None])
def test_a_model_without_a_config_form_is_not_exported_with_the_reason(tmp_path: Path, family: str | None) -> None:
    from tests.quant.tiny import tiny_decoder

    # Mixtral's config.json has one intermediate size; this model's dense and expert sizes differ.
    model = tiny_decoder(family) if family else nn.Sequential(nn.Linear(4, 2))
    outcome = export_hf(model, None, {}, tmp_path, _settings({"factory": "m:f"}))
    assert not outcome.exported and "no Hugging Face config.json for this model" in outcome.reason
    assert not (tmp_path / "hf").exists()


@torch.no_grad()
def test_fp8_layers_are_written_as_the_same_fp8_bytes_and_load(tmp_path: Path) -> None:
    """FP8 runs on CUDA only; its layers are built directly here (storage is the same on any device)."""
    from opus.quant.formats import FORMATS

    source = _tiny_llama(tmp_path, tie=False)
    model, _ = load_model({"hf": str(source)}, Path("."))
    for name in (n for n in _linears(model) if n != "lm_head"):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, FORMATS["fp8"].build(model.get_submodule(name), 64))
    outcome = export_hf(model, None, {}, tmp_path / "x", _settings({"hf": str(source)}))
    assert outcome.exported and outcome.metrics["hf_loads_in_transformers"] == 1, outcome.info
    config = json.loads((tmp_path / "x" / "hf" / "config.json").read_text())
    group = next(iter(config["quantization_config"]["config_groups"].values()))
    assert group["format"] == "float-quantized" and group["weights"]["type"] == "float"
    with safe_open(str(tmp_path / "x" / "hf" / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert stored.dtype == torch.float8_e4m3fn
    assert torch.equal(stored.view(torch.uint8), model.model.layers[1].mlp.down_proj.qweight.view(torch.uint8))
