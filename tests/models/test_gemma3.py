"""Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text) in Opus's decoder: (1 + w) norms, sandwich norms,
q/k norms, GeGLU, sqrt(hidden)-scaled embeddings, local/global layers with their own RoPE bases and
query_pre_attn_scalar. Parity with and without a cache is test_parity's; here the rest."""

from __future__ import annotations

import pytest
import torch
from opus_model_kit import VOCAB, hf_logits, make_hf, save_hf

from opus.models import DecoderLM, ModelLoadError, config_from_hf, load_model
from opus.models.decoder import BeyondSlidingWindow

# google/gemma-3-1b-it's config.json (transformers 4.50 keys), shrunk: no layer_types, no tie_word_embeddings.
CONFIG_4X = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 97,
             "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 7, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
             "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 32,
             "sliding_window_pattern": 6, "query_pre_attn_scalar": 16, "final_logit_softcapping": None,
             "attn_logit_softcapping": None, "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1}


def _ids(length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(2))


def test_a_4x_config_json_reads_as_transformers_does() -> None:
    cfg = config_from_hf(CONFIG_4X)
    assert cfg.family == "gemma3" and cfg.tie_word_embeddings and cfg.qk_norm and cfg.hidden_act == "gelu_tanh"
    assert cfg.sliding_layers == [True] * 5 + [False, True]  # every sixth layer global
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4 and cfg.sliding_window == 32
    assert cfg.norm_offset and cfg.sandwich_norms and cfg.embed_scale and cfg.attn_scale == 0.25
    import transformers as tf

    from_5x = config_from_hf(tf.Gemma3TextConfig(**{k: v for k, v in CONFIG_4X.items() if k not in (
        "architectures", "model_type", "rope_scaling", "rope_theta", "rope_local_base_freq")}).to_dict())
    assert from_5x == cfg  # the same model through transformers 5.x's keys


@pytest.mark.parametrize("change, says", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope type 'linear' is not supported"),
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_what_the_decoder_does_not_implement_is_refused(change, says) -> None:
    with pytest.raises(ModelLoadError, match=says):
        config_from_hf({**CONFIG_4X, **change})


def test_bfloat16_rounds_the_embedding_scale_as_transformers(tmp_path) -> None:
    # sqrt(72) = 8.485 is 8.5 in bfloat16: scaling in float32 would be a different model.
    ref = make_hf("gemma3", hidden_size=72).to(torch.bfloat16)
    model, _ = load_model({"hf": str(save_hf(ref, tmp_path / "g"))}, dtype="bfloat16")
    ids = _ids()
    with torch.no_grad():
        ours = model.model.embed_tokens(ids)
        got = model(ids).float()
        want = hf_logits(ref, ids).float()
    expected = ref.model.embed_tokens(ids)
    assert torch.equal(ours * torch.tensor(72**0.5).to(torch.bfloat16), expected)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_local_layers_are_guarded_global_layers_are_not(tmp_path) -> None:
    ref = make_hf("gemma3", sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    model, _ = load_model({"hf": str(save_hf(ref, tmp_path / "g"))})
    assert isinstance(model, DecoderLM)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 8]
    with torch.no_grad():
        assert (model(_ids(8)) - hf_logits(ref, _ids(8))).abs().max().item() < 1e-4
        with pytest.raises(BeyondSlidingWindow, match="sliding window of 8"):
            model(_ids(9))


def test_the_decoder_traces_and_the_fast_decoder_refuses(tmp_path) -> None:
    from opus.bench.static_path.fast_decoder import FastDecoder
    from opus.fusion.patterns import rmsnorm_reason

    model, _ = load_model({"hf": str(save_hf(make_hf("gemma3"), tmp_path / "g"))})
    gm = torch.fx.symbolic_trace(model, concrete_args={"cache": None, "start_pos": 0, "last_only": False})
    with torch.no_grad():
        assert torch.equal(gm(_ids(), None, 0, False), model(_ids()))
    assert "(1 + weight)" in (rmsnorm_reason(model.model.norm) or "")  # no fused norm kernel scales that way
    with pytest.raises(ValueError, match="FastDecoder does not run gemma3"):
        FastDecoder(model)
