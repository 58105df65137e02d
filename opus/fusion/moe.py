"""Grouped MoE: tokens sorted by expert, experts' weights stacked, no Python loop over float experts.

``GroupedMoE`` replaces ``opus.models.decoder.SparseMoE`` (same router, same routing arithmetic,
same shared expert). Parameter names: the router stays ``<moe>.gate.weight``; the experts become
``<moe>.experts.gate_up.weight [E, 2I, H]`` and ``<moe>.experts.down.weight [E, H, I]`` — new
tensors, saved in the checkpoint like any other. Quantized experts (one class and options for all of
them, gate/up and down alike) are kept per expert (``<moe>.experts.gate_up.experts.<e>.qweight`` …)
and run one expert's kernels at a time on its contiguous slice of the sorted rows.

Per expert, gate and up are first concatenated (``concat_linears``), then the E results are
stacked (``stack_linears``); both go through the registries in ``linear_ops``, so a quantized
linear class that registers its own rules is stacked too. Anything else is skipped with the reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opus.fusion.linear_ops import StackedLinear, StackedQuantLinear, concat_linears, stack_linears
from opus.fusion.ops import swiglu
from opus.models.layout import swiglu_parts


def moe_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot be grouped, or None when it can (exact routing semantics known)."""
    from opus.models.decoder import SparseMoE

    if not isinstance(module, SparseMoE):
        return f"{type(module).__name__}: routing semantics unknown (only Opus SparseMoE is grouped)"
    for expert in module.experts:
        if swiglu_parts(expert) is None:
            return f"expert {type(expert).__name__} is not gate/up/down SwiGLU"
    return None


class GroupedExperts(nn.Module):
    def __init__(self, gate_up: StackedLinear | StackedQuantLinear, down: StackedLinear | StackedQuantLinear,
                 top_k: int) -> None:
        super().__init__()
        self.gate_up, self.down, self.top_k = gate_up, down, top_k
        self.num_experts = gate_up.num_experts

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # Exporters and compilers want static shapes (and ONNX has no stable sort): every expert.
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            return self.dense(x, chosen, weights)
        flat = chosen.reshape(-1)  # [N * k] expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # stable: within an expert tokens stay in order
        token = torch.div(order, self.top_k, rounding_mode="floor")
        offsets = torch.cumsum(torch.bincount(flat, minlength=self.num_experts), 0).to(torch.int32)
        if isinstance(self.gate_up, StackedQuantLinear):
            y = self._expertwise(x[token], offsets)
        else:
            y = self.down.grouped(swiglu(self.gate_up.grouped(x[token], offsets)), offsets)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        # Sorted by expert, so each token sums its experts in expert order, as the loop did.
        return torch.zeros_like(x).index_add_(0, token, y)

    def _expertwise(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Quantized experts: gate/up, SwiGLU and down per expert on its slice of the sorted rows.
        The intermediates stay expert-sized: at prefill sizes, allocating them for all rows at once
        measured slower on CPU (fresh multi-MB buffers fault their pages in on every call)."""
        outs, start = [], 0
        for gate_up, down, end in zip(self.gate_up.experts, self.down.experts, offsets.tolist()):
            if end > start:
                outs.append(down(swiglu(gate_up(xs[start:end]))))
            start = end
        return torch.cat(outs) if outs else xs.new_zeros(0, self.down.out_features)

    def dense(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token (batched matmuls, or each quantized expert's kernels): static
        shapes, for exporters (and, float only, dense MoE layers and CUDA graphs)."""
        routing = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        routing = routing.scatter(1, chosen, weights)  # [N, E]
        if isinstance(self.gate_up, StackedQuantLinear):
            y = torch.stack([down(swiglu(gate_up(x))) for gate_up, down in zip(self.gate_up.experts,
                                                                               self.down.experts)])
        else:
            xe = x.unsqueeze(0).expand(self.num_experts, -1, -1)
            h = swiglu(torch.bmm(xe, self.gate_up.weight.transpose(1, 2)))
            y = torch.bmm(h, self.down.weight.transpose(1, 2))  # [E, N, H]
        return (routing.t().unsqueeze(-1) * y).sum(0)


class GroupedMoE(nn.Module):
    """SparseMoE with grouped experts; ``dense`` keeps the parent's meaning."""

    def __init__(self, moe: nn.Module, experts: GroupedExperts) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.norm_topk_prob, self.dense = moe.norm_topk_prob, moe.dense
        self.gate = moe.gate
        self.experts = experts
        self.shared_expert = moe.shared_expert
        self.shared_expert_gate = moe.shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = self.experts.dense(x, chosen, weights) if self.dense else self.experts(x, chosen, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def group_moe(module: nn.Module) -> GroupedMoE | str:
    """The grouped replacement of ``module``, or the reason it is not built."""
    reason = moe_reason(module)
    if reason:
        return reason
    parts = [p for p in map(swiglu_parts, module.experts) if p is not None]  # all of them: moe_reason checked
    gate_ups = []
    for gate, up, _ in parts:
        fused = concat_linears([gate, up])
        if isinstance(fused, str):
            return f"mixed/quantized experts: not stacked ({fused})"
        gate_ups.append(fused)
    gate_up = stack_linears(gate_ups)
    down = stack_linears([d for _, _, d in parts])
    for stacked in (gate_up, down):
        if isinstance(stacked, str):
            return stacked
    if type(gate_up) is not type(down) or (isinstance(gate_up, StackedQuantLinear)
                                           and type(gate_up.experts[0]) is not type(down.experts[0])):
        return "mixed/quantized experts: gate/up and down differ in precision"
    if module.dense and type(gate_up) is not StackedLinear:
        return "dense MoE needs plain stacked weights"
    return GroupedMoE(module, GroupedExperts(gate_up, down, module.top_k))
