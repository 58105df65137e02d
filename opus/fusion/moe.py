"""Grouped MoE: the experts' weights stacked, run in one of a few execution modes, no Python loop over
float experts. The one MoE expert implementation: the fuse stage builds it, measures its modes and
records the choice; the static CUDA-graph runner of the benchmarks (``fast_decoder``) uses it too.

``GroupedMoE`` replaces ``opus.models.decoder.SparseMoE`` (same router, same routing arithmetic,
same shared expert). Parameter names: the router stays ``<moe>.gate.weight``; the experts become
``<moe>.experts.gate_up.weight [E, 2I, H]`` and ``<moe>.experts.down.weight [E, H, I]`` — new
tensors, saved in the checkpoint like any other. Quantized experts (one class and options for all of
them, gate/up and down alike) are kept per expert (``<moe>.experts.gate_up.experts.<e>.qweight`` …).
The mode is not a tensor: it lives in the fuse recipe step (``experts``), so checkpoints are the same
whatever mode runs them.

Execution modes (``EXPERT_MODES``), each chosen per phase (``prefill``: several tokens per row,
``decode``: one):

* ``sorted`` (what every GroupedMoE ran before modes were chosen, and the default): token slots sorted
  by expert, each projection one ``grouped_linear`` (``torch._grouped_mm`` where it runs, else one
  padded ``bmm``); quantized experts run their own kernels on their contiguous slice. Host syncs
  (counts, padded width): never compiled or captured, so under ``torch.compile``, export or CUDA-graph
  capture it runs ``dense`` instead. In a compiled prefill (opus.kv.static) it runs as one opaque
  custom op (``opus::sorted_experts``), so the prompt keeps sparse routing instead of running every
  expert on every token; a compiled decode step still runs ``dense``.
* ``dense``: every expert on every token, weighted by the routing matrix (zero for experts a token did
  not pick). At decode batch sizes nearly every expert is hit anyway, so the weight bytes read — what
  bounds a decode step — are those of sparse routing, and the block is one GEMM for gate/up over all
  experts (``[N, E·2I]``) and one batched down projection summed over experts. Static shapes: what
  exporters, inductor and CUDA graphs run. Quantized experts: one gate/up call for all experts (their
  layers concatenated, a derived copy kept out of the state dict; small experts only), then each
  expert's down projection.
* ``grouped``: ``torch._grouped_mm`` with device-side offsets (counts from ``scatter_add_``, not
  ``bincount``, which syncs on CUDA), results un-sorted by the permutation and each token's k slots
  summed in one reduction (no atomics: deterministic). No host sync, so capturable. Float experts
  only, and only where ``torch._grouped_mm`` runs for the device and dtype (``mode_reason`` says why not).

Per expert, gate and up are first concatenated (``concat_linears``), then the E results are
stacked (``stack_linears``); both go through the registries in ``linear_ops``, so a quantized
linear class that registers its own rules is stacked too. Anything else is skipped with the reason.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from opus.fusion import native_experts
from opus.fusion.compiled_experts import compiled_experts, compiled_reason
from opus.fusion.linear_ops import (
    StackedLinear,
    StackedQuantLinear,
    concat_linears,
    grouped_mm_reason,
    stack_linears,
)
from opus.fusion.ops import swiglu
from opus.models.layout import swiglu_parts

EXPERT_MODES = ("sorted", "dense", "grouped", "compiled")
PHASES = ("prefill", "decode")
DEFAULT_MODES = {"prefill": "sorted", "decode": "sorted"}  # recipes written before modes were chosen
Stacked = StackedLinear | StackedQuantLinear


def moe_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot be grouped, or None when it can (exact routing semantics known)."""
    from opus.models.decoder import SparseMoE

    if not isinstance(module, SparseMoE):
        return f"{type(module).__name__}: routing semantics unknown (only Opus SparseMoE is grouped)"
    for expert in module.experts:
        if swiglu_parts(expert) is None:
            return f"expert {type(expert).__name__} is not gate/up/down SwiGLU"
    return None


def _static_mode(x: torch.Tensor, mode: str) -> str:
    """The mode that runs: ``dense`` where shapes must not depend on the routing."""
    if torch.compiler.is_exporting():
        return "dense"  # exporters want static shapes (and ONNX has no stable sort)
    if torch.compiler.is_compiling():  # inductor: static shapes, or one opaque op
        return {"sorted": "sorted_op", "compiled": "compiled_op"}.get(mode, "dense")
    # isinstance: under fx tracing ``x`` is a Proxy, and the traced graph is eager code (no capture).
    if mode == "sorted" and isinstance(x, torch.Tensor) and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return "dense"  # a CUDA graph cannot hold the sorted mode's host syncs
    return mode


_EXPERTS: weakref.WeakValueDictionary[int, GroupedExperts] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("opus::sorted_experts", mutates_args=())
def sorted_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, handle: int,
                   compiled: bool) -> torch.Tensor:
    """The sorted (or compiled) mode of the GroupedExperts registered as ``handle``, as one op a compiled
    graph calls (its host syncs and routing-sized shapes stay inside, where inductor never sees them)."""
    return _EXPERTS[handle].sorted(x, chosen, weights, compiled)


@sorted_experts.register_fake
def _(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, handle: int, compiled: bool) -> torch.Tensor:
    return torch.empty_like(x)


class GroupedExperts(nn.Module):
    def __init__(self, gate_up: Stacked, down: Stacked, top_k: int) -> None:
        super().__init__()
        self.gate_up, self.down, self.top_k = gate_up, down, top_k
        self.num_experts = gate_up.num_experts
        # The dense mode's gate/up for every expert in one call (every expert sees the same rows there): a
        # copy, made again whenever the experts' tensors load (a rebuilt model's experts start empty).
        self.gate_up_all = self._merged_gate_up()
        self.register_load_state_dict_post_hook(lambda module, _keys: setattr(module, "gate_up_all",
                                                                              module._merged_gate_up()))
        self._native_reason = native_experts.experts_reason(gate_up, down)
        self.handle = next(_HANDLES)  # how opus::sorted_experts finds these experts
        _EXPERTS[self.handle] = self

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy) is other experts: its own handle, or opus::sorted_experts would run the original's.
        super().__setstate__(state)
        self.handle = next(_HANDLES)
        _EXPERTS[self.handle] = self

    def _merged_gate_up(self) -> nn.Module | None:
        return self.gate_up.merged() if isinstance(self.gate_up, StackedQuantLinear) else None

    @property
    def quantized(self) -> bool:
        return isinstance(self.gate_up, StackedQuantLinear)

    def mode_reason(self, mode: str) -> str | None:
        """Why ``mode`` cannot run these experts on their device and dtype, or None when it can."""
        if mode not in EXPERT_MODES:
            return f"unknown experts mode {mode!r} (known: {', '.join(EXPERT_MODES)})"
        if mode == "compiled":
            device = next(itertools.chain(self.gate_up.parameters(), self.gate_up.buffers())).device
            return compiled_reason(self.gate_up, self.down, device)
        if mode != "grouped":
            return None
        if isinstance(self.gate_up, StackedQuantLinear):
            return f"{self.gate_up.fmt} experts have no grouped kernel (torch._grouped_mm takes float weights)"
        weight = self.gate_up.weight
        return grouped_mm_reason(weight.device, weight.dtype)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # The mode is no argument here: fx would trace it as a graph input and branch on a proxy.
        return self.run(x, chosen, weights, "sorted")

    def run(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, mode: str) -> torch.Tensor:
        """``x [N, H]``, ``chosen``/``weights [N, k]``: the experts' weighted sum per token."""
        mode = _static_mode(x, mode)
        if mode == "dense":
            return self.dense(x, chosen, weights)
        if mode == "sorted_op" and self.native_reason(x) is None:
            return native_experts.sorted_w8a8(self.gate_up, self.down, x, chosen, weights)
        if mode in ("sorted_op", "compiled_op"):
            return sorted_experts(x, chosen, weights, self.handle, mode == "compiled_op")
        if mode in ("grouped", "compiled"):
            reason = self.mode_reason(mode)
            if reason:
                raise ValueError(f"experts mode {mode!r} cannot run here: {reason}")
            return self.grouped(x, chosen, weights) if mode == "grouped" else self.sorted(x, chosen, weights, True)
        if mode != "sorted":
            raise ValueError(self.mode_reason(mode))
        return self.sorted(x, chosen, weights)

    def native_reason(self, x: torch.Tensor) -> str | None:
        """Why the sorted mode cannot run as opus.fusion.native_experts' C++ op on ``x``, or None."""
        return self._native_reason or native_experts.input_reason(x)

    def sorted(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               compiled: bool = False) -> torch.Tensor:
        if not compiled and self.native_reason(x) is None:
            return native_experts.sorted_w8a8(self.gate_up, self.down, x, chosen, weights)
        flat = chosen.reshape(-1)  # [N * k] expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # stable: within an expert tokens stay in order
        token = torch.div(order, self.top_k, rounding_mode="floor")
        offsets = torch.cumsum(torch.bincount(flat, minlength=self.num_experts), 0).to(torch.int32)
        if compiled:
            slot_weights = weights.reshape(-1)[order].unsqueeze(-1)
            return compiled_experts(self.gate_up, self.down, x, token, slot_weights, offsets.tolist())
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
        """Every expert on every token (one gate/up GEMM over all experts and a batched down
        projection, or each quantized expert's kernels): static shapes."""
        n, e = x.shape[0], self.num_experts
        routing = torch.zeros(n, e, dtype=x.dtype, device=x.device).scatter(1, chosen, weights)  # [N, E]
        if isinstance(self.gate_up, StackedQuantLinear):
            if self.gate_up_all is not None:  # one GEMM for every expert's gate/up, split per expert
                gate_ups = self.gate_up_all(x).chunk(e, dim=-1)
            else:
                gate_ups = tuple(gate_up(x) for gate_up in self.gate_up.experts)
            y = torch.stack([down(swiglu(gate_up)) for gate_up, down in zip(gate_ups, self.down.experts)])
            return (routing.t().unsqueeze(-1) * y).sum(0)
        w13, w2 = self.gate_up.weight, self.down.weight  # [E, 2I, H], [E, H, I]
        inter = w2.shape[-1]
        gu = F.linear(x, w13.reshape(e * 2 * inter, w13.shape[-1]))
        if self.gate_up.bias is not None:
            gu = gu + self.gate_up.bias.reshape(-1)
        gu = gu.view(n, e, 2, inter)
        # Routing weights on the activation (I wide) rather than the output (H wide): fewer multiplies.
        act = F.silu(gu[:, :, 0]) * gu[:, :, 1] * routing.unsqueeze(-1)  # [N, E, I]
        out = torch.bmm(act.transpose(0, 1), w2.transpose(1, 2)).sum(0)  # [E, N, H] summed over experts
        if self.down.bias is not None:
            out = out + routing @ self.down.bias
        return out

    def grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = torch.div(order, self.top_k, rounding_mode="floor")
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host on CUDA
        offs = torch.cumsum(counts, 0).to(torch.int32)
        expert = flat[order]  # the expert of each sorted row, for the biases
        h = torch._grouped_mm(x[token], self.gate_up.weight.transpose(1, 2), offs=offs)  # [N*k, 2I]
        if self.gate_up.bias is not None:
            h = h + self.gate_up.bias[expert]
        y = torch._grouped_mm(swiglu(h), self.down.weight.transpose(1, 2), offs=offs)
        if self.down.bias is not None:
            y = y + self.down.bias[expert]
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        # Un-sort (a permutation, no atomics: deterministic), then sum each token's k slots in one reduction.
        slots = torch.empty_like(y).index_copy_(0, order, y)
        return slots.view(x.shape[0], self.top_k, -1).sum(1)


class GroupedMoE(nn.Module):
    """SparseMoE with grouped experts; ``dense`` keeps the parent's meaning; ``modes`` maps each phase
    to the execution mode it runs (set by the fuse stage's choice or its recipe step)."""

    def __init__(self, moe: nn.Module, experts: GroupedExperts) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.norm_topk_prob, self.dense = moe.norm_topk_prob, moe.dense
        self.gate = moe.gate
        self.experts = experts
        self.shared_expert = moe.shared_expert
        self.shared_expert_gate = moe.shared_expert_gate
        self.modes = dict(DEFAULT_MODES)

    def mode_reason(self, mode: str) -> str | None:
        if self.dense and mode != "dense":
            return "this MoE runs every expert on every token (SparseMoE.dense): only the dense mode"
        return self.experts.mode_reason(mode)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen) ``[N, k]``: softmax in fp32, top-k, optional renormalisation."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """``mode`` overrides the phase's chosen mode (the static runner picks per call)."""
        shape = x.shape
        if mode is None:  # one token per row: a decode step ([B, 1, H] from the decoder layer)
            phase = "decode" if x.dim() == 3 and shape[1] == 1 else "prefill"
            mode = "dense" if self.dense else self.modes[phase]
            if phase == "decode" and torch.compiler.is_compiling():
                mode = "dense"  # a compiled decode step keeps the static dense experts it was measured with
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.route(x)
        out = self.experts.run(x, chosen, weights, mode)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def grouped_moe(moe: nn.Module, gate_up: nn.Module | str, down: nn.Module | str) -> GroupedMoE | str:
    """``moe``'s router and shared expert around stacked experts, or the reason it is not built."""
    for stacked in (gate_up, down):
        if isinstance(stacked, str):
            return stacked
    if type(gate_up) is not type(down) or (isinstance(gate_up, StackedQuantLinear)
                                           and type(gate_up.experts[0]) is not type(down.experts[0])):
        return "mixed/quantized experts: gate/up and down differ in precision"
    if moe.dense and type(gate_up) is not StackedLinear:
        return "dense MoE needs plain stacked weights"
    return GroupedMoE(moe, GroupedExperts(gate_up, down, moe.top_k))


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
    return grouped_moe(module, stack_linears(gate_ups), stack_linears([d for _, _, d in parts]))


def grouped_moes(model: nn.Module) -> list[tuple[str, GroupedMoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedMoE)]


def set_modes(model: nn.Module, modes: dict[str, str]) -> None:
    """Every GroupedMoE of ``model`` runs ``modes`` (phase -> mode; phases left out keep theirs)."""
    for _, moe in grouped_moes(model):
        moe.modes.update(modes)
