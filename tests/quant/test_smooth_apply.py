"""SmoothQuant is exact in float and makes W8A8 accurate; a quantized model round-trips via its recipe."""

from __future__ import annotations

import copy

import pytest
import torch

from opus.models.saved_state import changed_tensors
from opus.quant.apply import quantize_model, rebuild
from opus.quant.calibrate import ActivationStats, collect_stats
from opus.quant.smooth import apply_smoothing, smooth_groups
from tests.quant.tiny import blocks, tiny_decoder


@pytest.mark.parametrize("family", ["mixtral", "llama", "qwen2_moe"])
@torch.no_grad()
def test_smoothing_is_exact_in_float(family: str) -> None:
    model = tiny_decoder(family, outlier=30.0)
    data = blocks()
    ref = model(data)
    stats = collect_stats(model, data)
    alphas = apply_smoothing(model, stats, smooth_groups(model))
    assert alphas and all(0 < a < 1 for a in alphas.values())
    assert torch.allclose(model(data), ref, atol=2e-4, rtol=1e-4)


def _output_of(model: torch.nn.Module, name: str, data: torch.Tensor) -> torch.Tensor:
    seen = {}
    hook = model.get_submodule(name).register_forward_hook(lambda _m, _a, out: seen.setdefault("y", out))
    model(data)
    hook.remove()
    return seen["y"]


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@torch.no_grad()
def test_smoothing_makes_w8a8_accurate_on_outliers(family: str) -> None:
    # Outlier channels at the MLP input (planted in the norm), as in real LLMs. Measured at the block
    # output: end to end, a random MoE's routing flips would drown the effect in noise.
    base = tiny_decoder(family, outlier=60.0)
    data = blocks(8)
    block = "model.layers.0.mlp"
    ref = _output_of(base, block, data)
    stats = collect_stats(base, data)
    names = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(block)
             and n.endswith(("gate_proj", "up_proj"))]
    errors = {}
    for label, use_stats in (("plain", None), ("smooth", stats)):
        model = copy.deepcopy(base)
        quantize_model(model, {n: "w8a8" for n in names}, use_stats)
        errors[label] = float((_output_of(model, block, data) - ref).norm() / ref.norm())
    assert errors["smooth"] * 2 < errors["plain"], errors


def test_stats_save_and_load(tmp_path) -> None:  # noqa: ANN001
    model = tiny_decoder("llama")
    stats = collect_stats(model, blocks(), percentile=99.0)
    stats.save(tmp_path / "s.safetensors")
    again = ActivationStats.load(tmp_path / "s.safetensors")
    assert again.percentile == 99.0 and again.absmax.keys() == stats.absmax.keys()
    name = "model.layers.0.self_attn.q_proj"
    assert torch.equal(again.absmax[name], stats.absmax[name])
    assert (again.pctl[name] <= again.absmax[name] + 1e-6).all()


@torch.no_grad()
def test_quantized_model_round_trips_through_recipe_and_tensors() -> None:
    model = tiny_decoder("mixtral", outlier=20.0)
    marks = {n: (t.data_ptr(), t._version) for n, t in model.state_dict(keep_vars=True).items()}
    data = blocks()
    stats = collect_stats(model, data)
    assignment = {"model.layers.0.self_attn.q_proj": "w8a8", "model.layers.0.self_attn.k_proj": "w8a8",
                  "model.layers.0.self_attn.v_proj": "w8a8", "model.layers.0.mlp.experts.1.down_proj": "w4a16",
                  "model.layers.1.self_attn.o_proj": "w8a16", "lm_head": "bf16"}
    step = quantize_model(model, assignment, stats)
    out = model(data)
    tensors, aliases = changed_tensors(model, marks)
    assert "model.layers.0.self_attn.q_proj.qweight" in tensors
    assert "model.layers.0.input_layernorm.weight" in tensors  # smoothing folded into the norm
    assert "model.layers.1.mlp.experts.0.up_proj.weight" not in tensors  # untouched: not saved again
    fresh = rebuild(tiny_decoder("mixtral", outlier=20.0), step)
    fresh.load_state_dict(tensors, strict=False)
    assert torch.equal(fresh(data), out)


@torch.no_grad()
def test_checkpoints_with_the_older_transposed_int8_weight_still_load(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    from opus.models.saved_state import apply_state

    model, data = tiny_decoder("llama"), blocks()
    marks = {n: (t.data_ptr(), t._version) for n, t in model.state_dict(keep_vars=True).items()}
    step = quantize_model(model, {"model.layers.0.self_attn.o_proj": "w8a8"}, None)
    out = model(data)
    tensors, _ = changed_tensors(model, marks)
    name = "model.layers.0.self_attn.o_proj.qweight"
    tensors[name.replace("qweight", "qweight_t")] = tensors.pop(name).t().contiguous()  # the old layout
    save_file(tensors, str(tmp_path / "tensors.safetensors"))
    state = {"recipe": [step], "tensors": "tensors.safetensors"}
    loaded = apply_state(tiny_decoder("llama"), None, state, tmp_path, "cpu")
    assert torch.equal(loaded.model(data), out)


@torch.no_grad()
def test_smoothing_is_exact_for_gemma3_norms(tmp_path) -> None:  # noqa: ANN001
    """(1 + w) norms take the factor as (1 + w) / s - 1; the MLP's input is the pre-feed-forward norm's."""
    from opus.models import load_model
    from tests.models.opus_model_kit import make_hf, save_hf

    model, _ = load_model({"hf": str(save_hf(make_hf("gemma3"), tmp_path / "g"))})
    sources = {g.source: g.kind for g in smooth_groups(model)}
    assert sources["model.layers.0.pre_feedforward_layernorm"] == "norm"
    assert "model.layers.0.post_attention_layernorm" not in sources  # it normalises the attention output
    data = blocks(t=16, vocab=97)  # within the kit's sliding window
    ref = model(data)
    before = model.model.layers[0].pre_feedforward_layernorm.weight.clone()
    alphas = apply_smoothing(model, collect_stats(model, data), smooth_groups(model))
    assert alphas and not torch.equal(model.model.layers[0].pre_feedforward_layernorm.weight, before)
    assert torch.allclose(model(data), ref, atol=2e-4, rtol=1e-4)
