"""Logits parity of Opus's decoder against transformers, for every family, with and without a cache."""

from __future__ import annotations

import json

import pytest
import torch
from opus_model_kit import FAMILY_CASES, VOCAB, GrowingCache, hf_logits, make_hf, save_hf
from safetensors.torch import save_file

from opus.models import DecoderLM, load_model

TOL = 1e-4


def _ids(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _load(path) -> DecoderLM:
    model, _ = load_model({"hf": path.name}, base_dir=path.parent)  # relative path against base_dir
    assert isinstance(model, DecoderLM)
    return model


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_logits_and_cached_decode_match_transformers(family, tmp_path):
    ref = make_hf(family)
    model = _load(save_hf(ref, tmp_path / family))
    assert model.config.family == family
    ids = _ids()
    expected = hf_logits(ref, ids)
    with torch.no_grad():
        full = model(ids)
        assert full.shape == expected.shape
        assert (full - expected).abs().max().item() < TOL
        last = model(ids, last_only=True)
        assert last.shape == (2, 1, VOCAB)
        assert torch.allclose(last[:, 0], expected[:, -1], atol=TOL)
        # Prefill 5, a 3-token chunk at start_pos 5 (explicit mask path), then 1-token decode steps.
        cache = GrowingCache()
        steps = [model(ids[:, :5], cache=cache, start_pos=0), model(ids[:, 5:8], cache=cache, start_pos=5)]
        for pos in range(8, ids.shape[1]):
            steps.append(model(ids[:, pos : pos + 1], cache=cache, start_pos=pos))
        cached = torch.cat(steps, dim=1)
    assert (cached - expected).abs().max().item() < TOL
    assert cache.k[0].shape == (2, model.config.num_kv_heads, ids.shape[1], model.config.head_dim)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_dense_moe_mode_matches_sparse(family, tmp_path):
    model = _load(save_hf(make_hf(family), tmp_path / family))
    ids = _ids()
    with torch.no_grad():
        sparse = model(ids)
        for layer in model.model.layers:
            layer.mlp.dense = True
        dense = model(ids)
    assert (sparse - dense).abs().max().item() < TOL


def test_every_linear_is_plain_nn_linear(tmp_path):
    model = _load(save_hf(make_hf("qwen2_moe"), tmp_path / "m"))
    names = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    for expected in ("model.layers.0.mlp.gate", "model.layers.0.mlp.experts.3.gate_proj",
                     "model.layers.0.mlp.experts.3.up_proj", "model.layers.0.mlp.experts.3.down_proj",
                     "model.layers.0.mlp.shared_expert_gate", "model.layers.1.self_attn.q_proj", "lm_head"):
        assert expected in names
    assert not [p for p in model.parameters() if p.dim() == 3]  # no fused expert tensors


def test_fused_expert_layout_and_sharded_checkpoint(tmp_path):
    """transformers 5.x in-memory layout (gate_up_proj [E, 2I, H]) saved as is, in shards."""
    ref = make_hf("mixtral")
    src = save_hf(ref, tmp_path / "src")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((src / "config.json").read_text())
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    for file, names in shards.items():
        save_file({k: state[k] for k in names}, str(fused / file))
    index = {"metadata": {}, "weight_map": {k: f for f, names in shards.items() for k in names}}
    (fused / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = _ids()
    with torch.no_grad():
        assert (_load(fused)(ids) - hf_logits(ref, ids)).abs().max().item() < TOL


def test_tied_embeddings_and_mixed_dense_moe_layers(tmp_path):
    ref = make_hf("qwen2_moe", tie_word_embeddings=True, num_hidden_layers=3, mlp_only_layers=[1])
    model = _load(save_hf(ref, tmp_path / "m"))
    assert model.config.tie_word_embeddings and model.config.moe_layers == [True, False, True]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _ids()
    with torch.no_grad():
        assert (model(ids) - hf_logits(ref, ids)).abs().max().item() < TOL


def test_bfloat16_load(tmp_path):
    ref = make_hf("llama")
    model, _ = load_model({"hf": str(save_hf(ref, tmp_path / "m"))}, tmp_path, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    ids = _ids()
    with torch.no_grad():
        got, want = model(ids).float(), hf_logits(ref, ids)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
