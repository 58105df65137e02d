"""A model as JSON and safetensors bytes, and back (what a cluster task receives: opus.cluster.wire)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from opus.cluster.wire import NotShippable, pack_model, unpack_model
from opus.models import DecoderLM, ModelConfig
from opus.quant.apply import quantize_model
from opus.quant.calibrate import collect_stats
from tests.quant.tiny import blocks, tiny_decoder


def _tied() -> DecoderLM:
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    return DecoderLM(cfg).eval()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_a_packed_model_comes_back_the_same_with_its_extra_tensors(family: str) -> None:
    model, ids = tiny_decoder(family), blocks(2, 16)
    meta, blob = pack_model(model, {"blocks": ids})
    assert isinstance(blob, bytes) and json.loads(meta)["config"]["family"] == family
    rebuilt, extra = unpack_model(meta, blob)
    assert rebuilt is not model and torch.equal(extra["blocks"], ids)
    with torch.inference_mode():
        assert torch.equal(rebuilt(ids), model(ids))
    assert unpack_model(meta, blob)[0] is rebuilt  # a worker rebuilds a shared model once


def test_a_tied_head_stays_tied_and_one_untied_since_keeps_its_own_weights() -> None:
    tied = _tied()
    rebuilt, _ = unpack_model(*pack_model(tied))
    assert rebuilt.lm_head.weight is rebuilt.model.embed_tokens.weight
    tied.lm_head.weight = nn.Parameter(tied.lm_head.weight.detach() * 2, requires_grad=False)  # as a trial does
    rebuilt, _ = unpack_model(*pack_model(tied))
    assert torch.equal(rebuilt.lm_head.weight, tied.lm_head.weight)
    assert torch.equal(rebuilt.model.embed_tokens.weight, tied.model.embed_tokens.weight)


def test_what_a_task_could_not_rebuild_is_refused_with_the_reason() -> None:
    with pytest.raises(NotShippable, match="is a Linear, not an Opus decoder"):
        pack_model(nn.Linear(4, 4))
    model = tiny_decoder("llama")
    quantize_model(model, {"model.layers.0.mlp.down_proj": "w8a16"}, collect_stats(model, blocks(2, 16)),
                   group_size=32)
    with pytest.raises(NotShippable, match="already transformed"):
        pack_model(model)
