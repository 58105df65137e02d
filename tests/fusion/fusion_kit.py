"""Tiny Opus decoders for the fusion and KV tests (random weights big enough to give varied logits)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opus.models import DecoderLM, ModelConfig

VOCAB = 61
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {"qk_norm": True},
    "mixtral": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 24},
    "qwen2_moe": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 24, "qkv_bias": True,
                  "shared_expert_intermediate_size": 20},
}


def tiny_lm(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2,
            **overrides: Any) -> DecoderLM:
    kw: dict[str, Any] = dict(family=family, vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                              num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                              max_position_embeddings=256, **FAMILIES[family])
    kw.update(overrides)
    torch.manual_seed(seed)
    model = DecoderLM(ModelConfig(**kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model.to(dtype).eval()


def prompts(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class Branchy(nn.Module):
    """An MLP with data-dependent control flow: fx cannot trace it, eager runs it fine."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.inner(x)
        return self.inner(x) * 1.0

