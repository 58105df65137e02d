"""The optimized model back in its source layout: fused and grouped layers split exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opus.export.unfused import checkpoint_name, layers, other_tensors
from opus.fusion import FusionConfig, fuse_model, lm_probe
from opus.quant.apply import quantize_model
from opus.quant.formats import FORMATS
from tests.quant.tiny import blocks, tiny_decoder


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("fmt", ["w8a8", "w4a16"])
@torch.no_grad()
def test_fused_layers_split_back_to_what_the_unfused_model_computes(family: str, fmt: str) -> None:
    model = tiny_decoder(family)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("mlp.gate")
             and FORMATS[fmt].unsupported(m, 64) is None]  # e.g. qwen2_moe's 1-row shared-expert gate
    quantize_model(model, {n: fmt for n in names}, None, group_size=64)
    before = layers(model)
    fused = fuse_model(model, FusionConfig(), lm_probe(blocks(2, 16))).model
    assert any(n.endswith(("qkv_proj", "gate_up")) for n, _ in fused.named_modules())  # something was fused
    after = layers(fused)
    assert set(after) == set(before)
    assert {n for n, layer in after.items() if layer.fmt == fmt} == set(names)
    for name, layer in before.items():
        assert after[name].fmt == layer.fmt
        assert torch.equal(after[name].weight, layer.weight), name
    assert set(other_tensors(fused)) == set(other_tensors(model))
    assert all("norm" in n or "embed" in n for n in other_tensors(fused))


def test_checkpoint_names_follow_the_family_on_disk() -> None:
    assert checkpoint_name("model.layers.0.mlp.experts.3.gate_proj", "mixtral") == \
        "model.layers.0.block_sparse_moe.experts.3.w1"
    assert checkpoint_name("model.layers.0.mlp.experts.3.down_proj", "mixtral") == \
        "model.layers.0.block_sparse_moe.experts.3.w2"
    assert checkpoint_name("model.layers.0.mlp.gate", "mixtral") == "model.layers.0.block_sparse_moe.gate"
    assert checkpoint_name("model.layers.0.mlp.experts.3.up_proj", "qwen2_moe") == \
        "model.layers.0.mlp.experts.3.up_proj"
    assert checkpoint_name("model.layers.0.mlp.gate_proj", "llama") == "model.layers.0.mlp.gate_proj"
