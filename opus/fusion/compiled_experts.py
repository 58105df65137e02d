"""The ``compiled`` MoE experts mode: sorted routing, and each expert's whole computation one compiled
function.

In the sorted mode a quantized expert runs eagerly on its slice of the expert-sorted rows: the gather
of its tokens, the activations' quantization, the GEMM's dequantization, SwiGLU, the down projection's
quantization and the routing weight are each a pass over memory, and at prefill sizes those passes
(not the int8 GEMMs) are most of the MoE's time (K3, batch 32 × 512: 63 ms a layer, 23 ms compiled).
Here one function, compiled by inductor with dynamic row counts, does all of it around the GEMMs.

Where every expert of the layer has rows enough and the same kernels, one compiled call runs all of
them (one graph serves every such layer): each compiled call costs ~0.1 ms of dynamo and wrapper
around it, which at one 512-token prompt was a fifth of K3's prefill. It returns each expert's
weighted rows; they are summed into the output eagerly, per expert in expert order, as the sorted
mode sums them, so the two modes agree to the last bit where the compiled arithmetic rounds as eager
does. (Summed inside the graph, inductor's scatter-add took ~1 ms a layer for 1024 rows; concatenated
first, the copy cost more than the saving at batch 32.) Otherwise the experts are called one by one.

An expert runs eagerly instead where a layer has no pure kernel at that row count (``kernel`` returns
None: W8A8's weight-only branch for a handful of rows), a slice has one row (inductor specializes
sizes 0 and 1), or a dispatch mode is watching (the fuse stage's op counts: dynamo skips frames
under one). Runs on CPU (inductor's C++ kernels, measured there); on other devices the mode is
reported unavailable with the reason.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from opus import compile_watch
from opus.fusion.ops import swiglu

if TYPE_CHECKING:
    from opus.quant.modules import Kernel

BIG = 1 << 20  # a row count for asking whether a layer has a kernel at all


def _expert(x: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, up: Any, up_tensors: tuple,
            down: Any, down_tensors: tuple) -> torch.Tensor:
    return down(swiglu(up(x[token], *up_tensors)), *down_tensors) * weight


def _every_expert(x: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, ends: list[int], up: Any,
                  ups: tuple, down: Any, downs: tuple) -> list[torch.Tensor]:
    """Each expert's weighted rows, experts in order; ``ends`` each one's end in the sorted rows."""
    outs, start = [], 0
    for end, up_tensors, down_tensors in zip(ends, ups, downs):
        outs.append(_expert(x, token[start:end], weight[start:end], up, up_tensors, down, down_tensors))
        start = end
    return outs


@functools.cache
def _compiled(fn: Any) -> Any:
    compile_watch.watch()
    return torch.compile(fn, fullgraph=True, dynamic=True)


def compiled_reason(gate_up: nn.Module, down: nn.Module, device: torch.device) -> str | None:
    """Why the compiled mode cannot run these stacked experts, or None when it can."""
    if device.type != "cpu":
        return f"compiled experts run on CPU (inductor's C++ kernels, measured there), not on {device.type}"
    for stacked in (gate_up, down):
        if stacked.kernel(0, BIG) is None:
            return f"{getattr(stacked, 'fmt', type(stacked).__name__)} experts have no pure kernel to compile"
    return None


def _eager(stacked: nn.Module, kernel: Kernel | None, expert: int, x: torch.Tensor) -> torch.Tensor:
    if kernel is not None:
        fn, tensors = kernel
        return fn(x, *tensors)
    return stacked.experts[expert](x)  # a quantized layer's own path at this size


def compiled_experts(gate_up: nn.Module, down: nn.Module, x: torch.Tensor, token: torch.Tensor,
                     slot_weights: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """``x [N, H]``; ``token``/``slot_weights [N·k(, 1)]`` sorted by expert, ``ends`` each expert's end."""
    starts = [0, *ends[:-1]]
    kernels = [(gate_up.kernel(e, end - start), down.kernel(e, end - start)) for e, (start, end)
               in enumerate(zip(starts, ends))]
    watched = _get_current_dispatch_mode() is not None
    out = torch.zeros_like(x)
    if not watched and _one_call(kernels, starts, ends):
        (up_fn, _), (down_fn, _) = kernels[0]
        ys = _compiled(_every_expert)(x, token, slot_weights, ends, up_fn, tuple(up[1] for up, _ in kernels),
                                      down_fn, tuple(dn[1] for _, dn in kernels))
        for start, end, y in zip(starts, ends, ys):
            out.index_add_(0, token[start:end], y)
        return out
    for expert, (start, end, (up, dn)) in enumerate(zip(starts, ends, kernels)):
        if end > start:
            rows, weight = token[start:end], slot_weights[start:end]
            if up is not None and dn is not None and end - start > 1 and not watched:
                y = _compiled(_expert)(x, rows, weight, up[0], up[1], dn[0], dn[1])
            else:
                y = _eager(down, dn, expert, swiglu(_eager(gate_up, up, expert, x[rows]))) * weight
            out.index_add_(0, rows, y)
    return out


def _one_call(kernels: list[tuple[Kernel | None, Kernel | None]], starts: list[int], ends: list[int]) -> bool:
    """Whether one compiled call can run every expert: each has two rows or more (one graph for every
    routing, no 0/1 specializations) and a pure kernel, the same functions for all."""
    if any(end - start < 2 for start, end in zip(starts, ends)) or any(None in pair for pair in kernels):
        return False
    return len({(up[0], dn[0]) for up, dn in kernels}) == 1  # type: ignore[index]
