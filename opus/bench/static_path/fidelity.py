"""Fidelity of a fast path against a reference: teacher-forced logits and greedy-token agreement.

Teacher forcing feeds every contender the same tokens (the reference's greedy choices), so logits
stay comparable step after step even where greedy decoding of near-tied random-weight logits would
diverge after a token or two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from opus.bench.static_path.runner import StaticRunner
from opus.kv.cache import GrowingKVCache


def opus_forced(model: Any, ids: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Opus eager through its growing cache: logits of the prefill and of each forced token [B, 1+F, V]."""
    with torch.no_grad():
        cache = GrowingKVCache(model.config.num_layers)
        out = [model(ids, cache=cache, start_pos=0, last_only=True)[:, -1]]
        for j in range(forced.shape[1]):
            out.append(model(forced[:, j : j + 1], cache=cache, start_pos=ids.shape[1] + j, last_only=True)[:, -1])
    return torch.stack(out, 1).float()


def runner_forced(runner: StaticRunner, ids: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """The static runner (graphs and all): prefill logits, then one decode step per forced token."""
    out = [runner.prefill(ids).clone()]
    for j in range(forced.shape[1]):
        runner.decode_step(forced[:, j])
        out.append(runner.logits.clone())
    return torch.stack(out, 1).float()


def compare(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max |Δ|, cosine (mean, min over positions) and top-1 agreement of ``[B, S, V]`` logits."""
    cos = F.cosine_similarity(logits.flatten(0, 1), ref.flatten(0, 1), dim=-1)
    return {"max_abs_diff": float((logits - ref).abs().max()), "cos_mean": float(cos.mean()),
            "cos_min": float(cos.min()), "top1": float((logits.argmax(-1) == ref.argmax(-1)).float().mean())}


def agreement(tokens: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Greedy tokens ``[B, N]`` against a reference run: matches, first-token matches, common prefix."""
    same = tokens.cpu() == ref.cpu()
    prefix = same.int().cumprod(1).sum(1).float()
    return {"token_match": float(same.float().mean()), "first_token_match": float(same[:, 0].float().mean()),
            "prefix_frac": float((prefix / tokens.shape[1]).mean())}
