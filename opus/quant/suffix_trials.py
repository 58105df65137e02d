"""Cheaper sensitivity trials on an Opus decoder: start where the group starts, score what matters.

Quantizing one group leaves every layer before it unchanged, so a trial runs only the decoder's suffix,
from hidden states cached at the group's first layer. Its logits are scored on the reference's top-k
vocabulary per position plus the target token; the rest of the vocabulary is one "tail" bucket. The
tail's log-mass moves, to first order, by the tail-weighted mean of its logits' change, which is one
dot product per position: (Σ_tail w_v W_v) · Δx, the bracket computed once from the reference; the
rest (the spread of the change, which only adds mass) comes from a fixed sample of tail tokens drawn
by their reference weight. When the lm_head itself is on trial it runs whole and the log-partition
is exact. With ``top_k=None`` the
scores use the full vocabulary and equal the full measure's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opus.quant.groups import QGroup

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
HEAD = "lm_head"


def supports(model: nn.Module) -> bool:
    """Only Opus's own decoder: its forward is known, so running a slice of it is the same computation."""
    from opus.models.decoder import DecoderLM

    return isinstance(model, DecoderLM)


def start_layer(group: QGroup, num_layers: int) -> int:
    """The first decoder layer a group touches; ``num_layers`` for the lm_head (only the head runs)."""
    starts = []
    for name in group.modules:
        found = _LAYER.match(name)
        starts.append(int(found.group(1)) if found else num_layers if name == HEAD else 0)
    return min(starts)


class Trunk:
    """DecoderLM.forward in slices (no cache, causal, all positions): ``run(h, a, b)`` is layers a..b-1."""

    def __init__(self, model: nn.Module, seq_len: int, device: torch.device) -> None:
        self.model, self.cfg = model, model.config
        dtype = model.model.embed_tokens.weight.dtype
        positions = torch.arange(seq_len, device=device)
        self.rope = model.model.rotary_emb(positions, dtype)
        local = self.cfg.rope_local_theta
        self.rope_local = model.model.rotary_emb(positions, dtype, local) if local is not None else self.rope
        self.num_layers = len(model.model.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        from opus.models.decoder import scale_embedding

        h = self.model.model.embed_tokens(ids)
        return scale_embedding(h, self.cfg.hidden_size**0.5) if self.cfg.embed_scale else h

    def run(self, h: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        for i in range(start, self.num_layers if stop is None else stop):
            cos, sin = self.rope_local if self.cfg.sliding_layers[i] else self.rope
            h = self.model.model.layers[i](h, cos, sin, None, True)
        return h

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(h)


@dataclass
class Reference:
    """One batch's reference, kept only where trials are scored (or whole with the full vocabulary)."""

    targets: torch.Tensor  # [B, T-1] the next tokens
    logp: torch.Tensor  # [B, T, V] full vocabulary, or [B, T, K+1] at ``index``
    index: torch.Tensor | None = None  # [B, T, K+1]: top-k, then the target (its column masked if in top-k)
    keep: torch.Tensor | None = None  # [B, T, K+1] False where the target column repeats a top-k token
    target_col: torch.Tensor | None = None  # [B, T-1] the target's column in ``index``
    log_tail: torch.Tensor | None = None  # [B, T] log of the tail's logit mass, Σ exp(z) outside index
    lse: torch.Tensor | None = None  # [B, T] the reference's log-partition
    x: torch.Tensor | None = None  # [B, T, H] the lm_head's input
    tail_row: torch.Tensor | None = None  # [B, T, H] Σ_tail w_v W_v, w the tail's softmax weights
    sample: torch.Tensor | None = None  # [B, T, R] tail tokens drawn by w (fixed: every trial sees the same)
    sample_z: torch.Tensor | None = None  # [B, T, R] their reference logits


def reference(head: nn.Linear, x: torch.Tensor, ids: torch.Tensor, top_k: int | None) -> Reference:
    """The reference of one batch from the lm_head's input ``x``."""
    logits = head(x).float()
    targets = ids[:, 1:]
    if top_k is None or top_k + 1 >= logits.shape[-1]:
        return Reference(targets, F.log_softmax(logits, dim=-1))
    top = logits.topk(top_k, dim=-1).indices
    last = torch.cat([targets, top[:, -1:, 0]], dim=1)  # the last position has no target: repeat a top token
    index = torch.cat([top, last.unsqueeze(-1)], dim=-1)
    dup = (top == last.unsqueeze(-1)).any(-1)
    keep = torch.ones_like(index, dtype=torch.bool)
    keep[..., -1] = ~dup
    first = (top[:, :-1] == targets.unsqueeze(-1)).float().argmax(-1)  # the target's top-k column, if any
    target_col = torch.where(dup[:, :-1], first, torch.full_like(first, top_k))
    lse = logits.logsumexp(-1)
    z = _masked(logits.gather(-1, index), keep)
    # log(Σ_all e^z − Σ_S e^z) = lse + log(1 − e^(lse_S − lse)), kept finite when S holds all the mass
    share = (z.logsumexp(-1) - lse).clamp(max=-1e-7)
    log_tail = lse + torch.log(-torch.expm1(share))
    weights = (logits - log_tail.unsqueeze(-1)).exp().scatter(-1, index, 0.0)
    tail_row = weights.to(head.weight.dtype) @ head.weight
    flat = weights.reshape(-1, weights.shape[-1])
    # Where the top-k holds all the mass (the tail's weights underflow to 0) any draw will do: uniform.
    flat = torch.where(flat.sum(-1, keepdim=True) > 0, flat, torch.ones_like(flat))
    generator = torch.Generator(device=flat.device).manual_seed(0)
    sample = torch.multinomial(flat, top_k, replacement=True, generator=generator).reshape(*weights.shape[:2], -1)
    return Reference(targets, z - lse.unsqueeze(-1), index, keep, target_col, log_tail, lse, x, tail_row, sample,
                     logits.gather(-1, sample))


def _masked(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return z.masked_fill(~keep, float("-inf"))


@dataclass
class TrialLogits:
    z: torch.Tensor  # [B, T, V], or [B, T, K+1] at the reference's index
    lse: torch.Tensor | None = None  # [B, T] the log-partition (top-k only)
    tail_shift: torch.Tensor | None = None  # [B, T] the tail-weighted mean change of the tail's logits


def head_logits(model: nn.Module, x: torch.Tensor, ref: Reference, head_in_trial: bool) -> TrialLogits:
    """The trial's logits at the reference's columns, with its log-partition.

    Only the rows needed are multiplied, unless the head itself is on trial (its hooks fake-quantize
    its input, and the tail moves with its weights): then it runs whole and the partition is exact."""
    if ref.index is None:
        return TrialLogits(model.lm_head(x).float())
    assert ref.x is not None and ref.tail_row is not None and ref.log_tail is not None
    assert ref.sample is not None and ref.sample_z is not None
    columns = torch.cat([ref.index, ref.sample], dim=-1)
    if head_in_trial:
        logits = model.lm_head(x).float()
        z, drawn = logits.gather(-1, columns).split([ref.index.shape[-1], ref.sample.shape[-1]], dim=-1)
        moved = drawn - ref.sample_z
        return TrialLogits(z, logits.logsumexp(-1), moved.mean(-1))  # the shift: sampled, unbiased
    head = model.lm_head
    out = torch.empty(columns.shape, dtype=torch.float32, device=x.device)
    for b in range(x.shape[0]):  # one sequence at a time: the gathered rows are [T, columns, hidden]
        z = torch.einsum("tkh,th->tk", head.weight[columns[b]], x[b])
        out[b] = (z + head.bias[columns[b]] if head.bias is not None else z).float()
    z, drawn = out.split([ref.index.shape[-1], ref.sample.shape[-1]], dim=-1)
    shift = ((x - ref.x) * ref.tail_row).sum(-1).float()  # exact: Σ_tail w_v W_v·Δx
    moved = drawn - ref.sample_z
    spread = (moved - moved.mean(-1, keepdim=True)).exp().mean(-1).log()  # its higher orders, sampled
    lse = torch.logaddexp(_masked(z, ref.keep).logsumexp(-1), ref.log_tail + shift + spread)
    return TrialLogits(z, lse, shift)


def scores(trial: TrialLogits, ref: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the batch of (Δ cross-entropy over positions with a target, KL over all positions)."""
    if ref.index is None:
        logp = F.log_softmax(trial.z, dim=-1)
        ce = -logp[:, :-1].gather(-1, ref.targets.unsqueeze(-1)).squeeze(-1)
        ce_ref = -ref.logp[:, :-1].gather(-1, ref.targets.unsqueeze(-1)).squeeze(-1)
        kl = (ref.logp.exp() * (ref.logp - logp)).sum(-1)
        return (ce - ce_ref).sum(), kl.sum()
    assert ref.keep is not None and ref.log_tail is not None and ref.target_col is not None
    assert ref.lse is not None and trial.lse is not None and trial.tail_shift is not None
    logp = _masked(trial.z, ref.keep) - trial.lse.unsqueeze(-1)
    col = ref.target_col.unsqueeze(-1)
    dce = -(logp[:, :-1].gather(-1, col) - ref.logp[:, :-1].gather(-1, col)).squeeze(-1)
    p = ref.logp.exp()
    inside = torch.where(ref.keep, p * (ref.logp - logp), torch.zeros_like(p)).sum(-1)
    # Within the tail: Σ p_v (log p_v − log q_v) = P_tail (Δlse − mean Δz), the mean weighted as p is.
    tail = (ref.log_tail - ref.lse).exp() * (trial.lse - ref.lse - trial.tail_shift)
    return dce.sum(), (inside + tail).sum()
