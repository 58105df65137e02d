"""Long free-running generation, scored by the unmodified model: what teacher-forced measures never run.

A quantized model can keep its perplexity and still lose its way after a few hundred generated tokens
(a cache or position path that a forward over given text never takes). Exact token agreement cannot tell
that from harmless divergence on a real model: one early near-tie sends the rest of a greedy text
elsewhere (SmolLM2: 0.22-0.48 over 32 tokens with a correct decode path). So each side generates greedily
through its own cache, and the *unmodified* model scores both texts: its mean negative log-likelihood per
token, by segment of the generation. A collapse shows as a segment whose NLL jumps above what the
unmodified model's own greedy text costs it there.

Metrics: ``long_nll`` (the candidate's text, mean over every generated token), ``long_nll_base`` (the
unmodified model's own text), ``long_nll_increase_max`` (the worst segment's candidate minus base NLL,
nats per token: a gate's ``max``). Per-segment values go to the stage's info.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opus.runtime.engine import generate

Factory = Callable[[int, int], Any]
METRICS = frozenset({"long_nll", "long_nll_base", "long_nll_increase_max"})


@torch.no_grad()
def continuation_nll(scorer: nn.Module, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows, new] NLL of each generated token under ``scorer``, given the prompt and the tokens before it
    (one forward per row, no cache: the scorer's plain path)."""
    device = next(scorer.parameters()).device
    out = []
    for prompt, new in zip(prompts, tokens):
        ids = torch.cat([prompt, new]).unsqueeze(0).to(device)
        logits = scorer(ids)[0, prompt.numel() - 1: -1].float()
        out.append(F.cross_entropy(logits, new.to(device), reduction="none").cpu())
    return torch.stack(out)


def score_long_generation(candidate: nn.Module, candidate_factory: Factory, base: nn.Module, base_factory: Factory,
                          prompts: torch.Tensor, new_tokens: int, segment: int,
                          on_step: Callable[[int], None] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """Both models generate ``new_tokens`` greedily from ``prompts`` through their own caches; ``base`` scores
    both texts. Returns (metrics, info with the per-segment NLLs)."""
    ours = generate(candidate, prompts, new_tokens, candidate_factory, on_step=on_step).tokens.cpu()
    theirs = generate(base, prompts, new_tokens, base_factory, on_step=on_step).tokens.cpu()
    nll_ours = continuation_nll(base, prompts.cpu(), ours)
    nll_theirs = continuation_nll(base, prompts.cpu(), theirs)
    bounds = [(start, min(start + segment, new_tokens)) for start in range(0, new_tokens, segment)]
    seg_ours = [float(nll_ours[:, a:b].mean()) for a, b in bounds]
    seg_theirs = [float(nll_theirs[:, a:b].mean()) for a, b in bounds]
    metrics = {"long_nll": float(nll_ours.mean()), "long_nll_base": float(nll_theirs.mean()),
               "long_nll_increase_max": max(o - t for o, t in zip(seg_ours, seg_theirs))}
    info = {"prompts": int(prompts.shape[0]), "new_tokens": new_tokens, "segments": [
        {"tokens": [a, b], "nll": round(o, 4), "nll_base": round(t, 4)}
        for (a, b), o, t in zip(bounds, seg_ours, seg_theirs)]}
    return metrics, info
