"""MoE experts as stacked weights: batched matmuls, no Python loop over experts, static shapes.

Same router and arithmetic as ``opus.models.decoder.SparseMoE`` (softmax in fp32, top-k, optional
renormalisation, optional sigmoid-gated shared expert). Three ways to run the experts:

* ``dense`` (decode): every expert on every token, weighted by the routing matrix (zero for the
  experts a token did not pick). At batch 32 with top-4 of 32 experts nearly every expert is hit
  anyway, so the weight bytes read — what bounds a decode step — are the same as sparse routing,
  and the whole block is two GEMMs plus elementwise work: ``x @ W13ᵀ`` over all experts at once
  (``[N, E·2I]``), then a batched down projection summed over experts. Capturable.
* ``grouped`` (prefill, and optionally decode): token slots sorted by expert and one
  ``torch._grouped_mm`` per projection with device-side offsets; results are un-sorted by the
  permutation and each token's k slots summed in one reduction (no atomics: deterministic). No
  host sync, so it is capturable too (counts come from ``scatter_add_``, not ``bincount``, which
  syncs on CUDA).
* ``loop``: one matmul per expert on the tokens routed to it — the fallback where ``_grouped_mm``
  cannot run (CUDA in fp32/fp16, or an old torch); data-dependent shapes, never captured.

Quantized experts: the E experts' gate/up weights concatenated are one ``[E·2I, H]`` linear and their
down weights one ``[H, E·I]`` linear, so the dense decode path runs them through opus.quant modules
(fp8 / w8a8 / w4a16) as two ordinary quantized GEMMs. Caveat: the down linear has one scale per
output channel across all experts (a per-expert scale would need a batched scaled GEMM). Prefill
dequantizes them to the model dtype, per layer and per call, for the grouped path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opus.gpu.qlinear import dequantize, linear_from_weight, quantize_linear

EXPERT_MODES = ("dense", "grouped", "loop")
_GROUPED_OK: dict[tuple[str, torch.dtype], str | None] = {}


def grouped_mm_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` cannot run here (probed once per device type and dtype), or None."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        _GROUPED_OK[key] = _probe_grouped_mm(device, dtype)
    return _GROUPED_OK[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=gen).to(device, dtype)
    w = torch.randn(3, 128, 64, generator=gen).to(device, dtype)  # [E, out, in]
    offs = torch.tensor([5, 29, 40], dtype=torch.int32, device=device)  # unaligned group sizes
    try:
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return f"torch._grouped_mm unavailable for {dtype} on {device.type}: {str(e).splitlines()[0]}"
    ref = torch.cat([x[:5] @ w[0].t(), x[5:29] @ w[1].t(), x[29:] @ w[2].t()])
    if not torch.allclose(y.float(), ref.float(), atol=0.2, rtol=0.05):
        return f"torch._grouped_mm gave wrong results for {dtype} on {device.type}"
    return None


class StackedExperts(nn.Module):
    """Replacement of one SparseMoE block for the static path (built from it, never modifying it)."""

    def __init__(self, moe: nn.Module, quant: str | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.gate = moe.gate
        self.shared_expert, self.shared_expert_gate = moe.shared_expert, moe.shared_expert_gate
        experts = list(moe.experts)
        for e, expert in enumerate(experts):
            for name in ("gate_proj", "up_proj", "down_proj"):
                if type(getattr(expert, name, None)) is not nn.Linear:
                    raise TypeError(f"expert {e}.{name} is not an nn.Linear: StackedExperts takes float experts")
        self.inter = experts[0].gate_proj.out_features
        self.hidden = experts[0].gate_proj.in_features
        self.notes: list[str] = []
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])  # [E, 2I, H]
            w2 = torch.stack([e.down_proj.weight for e in experts])  # [E, H, I]
        self.gate_up: nn.Module | None = None
        self.down: nn.Module | None = None
        if quant is not None:
            e, i, h = self.num_experts, self.inter, self.hidden
            gate_up, why_gu = quantize_linear(linear_from_weight(w13.reshape(e * 2 * i, h)), quant)
            down, why_d = quantize_linear(linear_from_weight(w2.permute(1, 0, 2).reshape(h, e * i)), quant)
            if why_gu is None and why_d is None:
                self.gate_up, self.down = gate_up, down
                w13 = w2 = None
            else:
                self.notes.append(f"experts kept in {str(w13.dtype).removeprefix('torch.')}: {why_gu or why_d}")
        self.register_buffer("w13", w13, persistent=False)
        self.register_buffer("w2", w2, persistent=False)

    @property
    def quantized(self) -> bool:
        return self.gate_up is not None

    def stacks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in ``dtype`` (dequantized when the experts are quantized)."""
        if self.gate_up is None or self.down is None:
            return self.w13, self.w2
        e, i, h = self.num_experts, self.inter, self.hidden
        w13 = dequantize(self.gate_up).to(dtype).reshape(e, 2 * i, h)
        w2 = dequantize(self.down).to(dtype).reshape(h, e, i).permute(1, 0, 2).contiguous()
        return w13, w2

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor, mode: str = "dense") -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.route(x)
        if mode == "dense":
            out = self.dense(x, chosen, weights)
        elif mode == "grouped":
            out = self.grouped(x, chosen, weights)
        elif mode == "loop":
            out = self.loop(x, chosen, weights)
        else:
            raise ValueError(f"unknown experts mode {mode!r} (known: {', '.join(EXPERT_MODES)})")
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def dense(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, e, i = x.shape[0], self.num_experts, self.inter
        routing = torch.zeros(n, e, dtype=x.dtype, device=x.device).scatter(1, chosen, weights)  # [N, E]
        if self.gate_up is not None and self.down is not None:
            gu = self.gate_up(x).view(n, e, 2, i)
            act = F.silu(gu[:, :, 0]) * gu[:, :, 1] * routing.unsqueeze(-1)  # [N, E, I]
            return self.down(act.reshape(n, e * i))
        gu = F.linear(x, self.w13.view(e * 2 * i, self.hidden)).view(n, e, 2, i)
        act = F.silu(gu[:, :, 0]) * gu[:, :, 1] * routing.unsqueeze(-1)
        return torch.bmm(act.transpose(0, 1), self.w2.transpose(1, 2)).sum(0)  # [E, N, H] summed over E

    def _sorted(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order, token, counts): token slots sorted by expert (stable), their tokens, tokens per expert."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = torch.div(order, self.top_k, rounding_mode="floor")
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host on CUDA
        return order, token, counts

    def grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, token, counts = self._sorted(chosen)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        w13, w2 = self.stacks(x.dtype)
        h = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs)  # [N*k, 2I]
        act = F.silu(h[:, : self.inter]) * h[:, self.inter :]
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs) * weights.reshape(-1)[order].unsqueeze(-1)
        # Un-sort (a permutation, no atomics: deterministic), then sum each token's k slots in one reduction.
        slots = torch.empty_like(y).index_copy_(0, order, y)
        return slots.view(x.shape[0], self.top_k, -1).sum(1)

    def loop(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.stacks(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tokens, slots = torch.where(chosen == e)
            h = x[tokens] @ w13[e].t()
            act = F.silu(h[:, : self.inter]) * h[:, self.inter :]
            out = out.index_add(0, tokens, (act @ w2[e].t()) * weights[tokens, slots].unsqueeze(-1))
        return out
