"""``factory:`` returning a transformers causal LM: a known family becomes Opus's decoder (logits equal),
another is refused before it runs, naming its class (opus.models.load.from_transformers / check_factory)."""

from __future__ import annotations

import pytest
import torch
from opus_model_kit import VOCAB, hf_logits, make_hf

from opus.models import DecoderLM, ModelLoadError, load_model
from opus.models.load import check_factory


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("qwen3", {}), ("mixtral", {}),
                                               ("qwen2_moe", {"tie_word_embeddings": True})])
def test_a_transformers_factory_becomes_the_opus_decoder(family, overrides) -> None:
    model, tokenizer = load_model({"factory": "opus_model_kit:hf_factory",
                                   "args": {"family": family, "seed": 4, **overrides}})
    assert isinstance(model, DecoderLM) and model.config.family == family and tokenizer is None
    ref = make_hf(family, seed=4, **overrides)
    ids = _ids()
    with torch.no_grad():
        assert (model(ids) - hf_logits(ref, ids)).abs().max().item() < 1e-4
    assert not model.training
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtype_applies_to_the_converted_model() -> None:
    model, _ = load_model({"factory": "opus_model_kit:hf_factory"}, dtype="bfloat16")
    assert isinstance(model, DecoderLM) and model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("factory, says", [
    ("gpt2_factory", r"returned GPT2LMHeadModel \(model_type 'gpt2'\), a transformers model of a family Opus "
                     "cannot load into its own decoder"),
    ("llama_trunk_factory", "returned LlamaModel, not a LlamaForCausalLM"),
])
def test_other_transformers_models_are_refused_naming_the_class(factory, says) -> None:
    source = {"factory": f"opus_model_kit:{factory}"}
    with pytest.raises(ModelLoadError, match=says) as err:
        check_factory(source)  # on the meta device: before anything runs
    assert "\n" not in str(err.value)
    with pytest.raises(ModelLoadError, match=says):
        load_model(source)


def test_an_unsupported_config_is_refused_before_the_run() -> None:
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ModelLoadError, match="returned LlamaForCausalLM: rope type 'linear' is not supported"):
        check_factory({"factory": "opus_model_kit:hf_factory", "args": {"rope_parameters": rope}})


def test_the_check_builds_nothing_and_leaves_the_rng_alone() -> None:
    torch.manual_seed(11)
    before = torch.rand(3)
    torch.manual_seed(11)
    check_factory({"factory": "opus_model_kit:hf_factory"})
    check_factory({"factory": "opus_model_kit:make_factory_model"})  # a plain nn.Module: the generic path
    assert torch.equal(torch.rand(3), before)
    with pytest.raises(ModelLoadError, match="cannot import module 'no_such_module_xyz'"):
        check_factory({"factory": "no_such_module_xyz:f"})
