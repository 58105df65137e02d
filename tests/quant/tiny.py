"""Tiny Opus decoder models for quantization tests, with a planted activation outlier."""

from __future__ import annotations

import torch

from opus.models import DecoderLM, ModelConfig


def tiny_decoder(family: str = "mixtral", seed: int = 0, outlier: float = 0.0) -> DecoderLM:
    moe = family in ("mixtral", "qwen2_moe")
    cfg = ModelConfig(family=family, vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, num_experts=4 if moe else 0, top_k=2 if moe else 0,
                      moe_intermediate_size=128 if moe else 0,
                      shared_expert_intermediate_size=128 if family == "qwen2_moe" else 0)
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p))
        if outlier:
            # A few channels 'outlier'× larger at every MLP input: what real LLM activations look like.
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight[:3] *= outlier
    return model.eval()


def blocks(n: int = 4, t: int = 32, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))
