"""The ``compiled`` MoE experts mode: sorted routing, and each expert's whole computation one compiled
function.

In the sorted mode a quantized expert runs eagerly on its slice of the expert-sorted rows: the gather
of its tokens, the activations' quantization, the GEMM's dequantization, SwiGLU, the down projection's
quantization and the routing weight are each a pass over memory, and at prefill sizes those passes
(not the int8 GEMMs) are most of the MoE's time (K3, batch 32 × 512: 63 ms a layer, 23 ms compiled).
Here one function, compiled by inductor with a dynamic row count, does all of it around the two GEMMs:
one graph serves every expert of every layer whose kernels are the same functions. Token rows are
summed into the output per expert in expert order, as the sorted mode sums them, so the two modes
agree to the last bit where the compiled arithmetic rounds as eager does.

An expert runs eagerly instead where a layer has no pure kernel at that row count (``kernel`` returns
None: W8A8's weight-only branch for a handful of rows), a slice has one row (inductor specializes
sizes 0 and 1), or a dispatch mode is watching (the fuse stage's op counts: dynamo skips frames
under one). Runs on CPU (inductor's C++ kernels, measured there); on other devices the mode is
reported unavailable with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from opus.fusion.ops import swiglu

if TYPE_CHECKING:
    from opus.quant.modules import Kernel

_COMPILED: Any = None
BIG = 1 << 20  # a row count for asking whether a layer has a kernel at all


def _expert(x: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, up: Any, up_tensors: tuple,
            down: Any, down_tensors: tuple) -> torch.Tensor:
    return down(swiglu(up(x[token], *up_tensors)), *down_tensors) * weight


def _compiled() -> Any:
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_expert, fullgraph=True, dynamic=True)
    return _COMPILED


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
    out, start = torch.zeros_like(x), 0
    for expert, end in enumerate(ends):
        if end > start:
            rows, weight, count = token[start:end], slot_weights[start:end], end - start
            up, dn = gate_up.kernel(expert, count), down.kernel(expert, count)
            if up is not None and dn is not None and count > 1 and _get_current_dispatch_mode() is None:
                y = _compiled()(x, rows, weight, up[0], up[1], dn[0], dn[1])
            else:
                y = _eager(down, dn, expert, swiglu(_eager(gate_up, up, expert, x[rows]))) * weight
            out.index_add_(0, rows, y)
        start = end
    return out
