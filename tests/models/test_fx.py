"""torch.fx.symbolic_trace works on Opus decoders (the reason they exist: transformers 5.x fails)."""

from __future__ import annotations

import pytest
import torch
from opus_model_kit import VOCAB, make_hf, save_hf

from opus.models import load_model

CONCRETE = {"cache": None, "start_pos": 0}


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3"])
def model(request, tmp_path_factory):
    path = save_hf(make_hf(request.param), tmp_path_factory.mktemp(request.param))
    return load_model({"hf": str(path)})[0]


def test_whole_model_traces_and_matches_eager(model):
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    for last_only in (False, True):
        gm = torch.fx.symbolic_trace(model, concrete_args={**CONCRETE, "last_only": last_only})
        with torch.no_grad():
            assert torch.equal(gm(ids, None, 0, last_only), model(ids, last_only=last_only))
    linears = [n for n in gm.graph.nodes if n.op == "call_module" and "proj" in str(n.target)]
    assert linears  # linear layers stay call_module nodes: quantization can swap them by name


def test_block_modules_trace_alone(model):
    layer = model.model.layers[0]
    x = torch.randn(2, 5, model.config.hidden_size)
    mlp = torch.fx.symbolic_trace(layer.mlp)
    with torch.no_grad():
        assert torch.allclose(mlp(x), layer.mlp(x))
    targets = {n.target for n in mlp.graph.nodes if n.op == "call_module"}
    if model.config.num_experts:
        assert {"gate", "experts.0.gate_proj", "experts.0.up_proj", "experts.0.down_proj"} <= targets
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        torch.fx.symbolic_trace(getattr(layer.self_attn, proj))
    cos, sin = model.model.rotary_emb(torch.arange(5), x.dtype)
    attn = torch.fx.symbolic_trace(layer.self_attn, concrete_args={"cache": None, "causal": True})
    with torch.no_grad():
        assert torch.allclose(attn(x, cos, sin), layer.self_attn(x, cos, sin))
