"""Does the fused model still compute the same? Compared against outputs recorded before fusion.

For an LM: the reference model's greedy continuation of fixed prompts (through the KV cache, as the
engine runs it) and its logits at every prompt position (no cache). The fused model is run along
the *same* token path (teacher-forced), so one early near-tie cannot cascade into a wrong verdict:

- ``fusion_exact_match``: share of steps where the fused model's greedy token equals the reference's;
- ``fusion_max_abs_diff``: max |logit difference| over all those steps and prompt positions;
- ``fusion_cosine``: mean cosine of logit vectors (``fusion_cosine_min`` the worst one).

For any other module: its outputs on fixed inputs, argmax agreement along the last dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from opus.kv import cache as kvcache
from opus.runtime import engine


@dataclass
class Reference:
    inputs: Any  # LM: prompts [B, T]; generic: a tuple of inputs
    tokens: torch.Tensor | None  # LM: reference greedy tokens [B, n]
    outputs: list[torch.Tensor]  # LM: [step logits [B, n, V], full logits [B, T, V]]; generic: leaves


def forced_logits(model: nn.Module, prompts: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Logits [B, n, V] along a given continuation ``forced`` [B, n], through a fresh KV cache."""
    batch, length = prompts.shape
    steps = forced.shape[1]
    cache = kvcache.cache_factory(model)(batch, length + steps)
    out = []
    with torch.inference_mode():
        logits = engine.logits_of(model(prompts, cache=cache, start_pos=0, last_only=True))[:, -1]
        out.append(logits.float())
        for i in range(1, steps):
            step = model(forced[:, i - 1 : i], cache=cache, start_pos=length + i - 1, last_only=True)
            out.append(engine.logits_of(step)[:, -1].float())
    return torch.stack(out, dim=1)


def lm_reference(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> Reference:
    result = engine.generate(model, prompts, new_tokens, return_logits=True)
    full = engine.full_logits(model, prompts).float()
    return Reference(prompts, result.tokens, [result.logits, full])


def generic_reference(model: nn.Module, inputs: tuple[Any, ...]) -> Reference:
    with torch.inference_mode():
        leaves, _ = tree_flatten(model(*inputs))
    return Reference(inputs, None, [t.detach().float().clone() for t in leaves if isinstance(t, torch.Tensor)])


def _outputs(model: nn.Module, ref: Reference) -> list[torch.Tensor]:
    if ref.tokens is not None:
        return [forced_logits(model, ref.inputs, ref.tokens), engine.full_logits(model, ref.inputs).float()]
    with torch.inference_mode():
        leaves, _ = tree_flatten(model(*ref.inputs))
    return [t.float() for t in leaves if isinstance(t, torch.Tensor)]


def compare(model: nn.Module, ref: Reference) -> dict[str, float]:
    got = _outputs(model, ref)
    if len(got) != len(ref.outputs) or any(g.shape != r.shape for g, r in zip(got, ref.outputs)):
        return {"fusion_max_abs_diff": float("inf"), "fusion_cosine": 0.0, "fusion_cosine_min": 0.0,
                "fusion_exact_match": 0.0}
    diff = max(float((g - r).abs().max()) for g, r in zip(got, ref.outputs))
    cos = torch.cat([F.cosine_similarity(g.reshape(-1, g.shape[-1]), r.reshape(-1, r.shape[-1]), dim=-1)
                     for g, r in zip(got, ref.outputs)])
    if ref.tokens is not None:
        match = (got[0].argmax(-1) == ref.tokens.to(got[0].device)).float().mean()
    else:
        match = torch.cat([(g.argmax(-1) == r.argmax(-1)).float().reshape(-1) for g, r in zip(got, ref.outputs)
                           if g.dim() > 0]).mean()
    return {"fusion_max_abs_diff": diff, "fusion_cosine": float(cos.mean()), "fusion_cosine_min": float(cos.min()),
            "fusion_exact_match": float(match)}
