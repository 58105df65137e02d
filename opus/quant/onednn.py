"""oneDNN's packed int8 GEMM (``opus::onednn_int8_linear``; opus.quant.packed has the mechanism).

oneDNN's ``qlinear`` takes a weight packed once (``onednn.qlinear_prepack``) and is the kernel
PyTorch's own x86 int8 path lowers to; it runs on AMX tiles where the CPU has them. Measured here it
wins at prefill sizes, and loses to FBGEMM (opus.quant.fbgemm) at one to a few rows.
"""

from __future__ import annotations

import torch

from opus.quant.packed import PackedKernel, register


def _missing() -> str | None:
    if not hasattr(torch.ops.onednn, "qlinear_prepack") or not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN int8 linear (onednn.qlinear_prepack)"
    return None


def _pack(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The weight's scales as the op takes them, kept with the twin rather than made on every call.
    return (torch.ops.onednn.qlinear_prepack(qweight, None), torch.zeros(qweight.shape[0], dtype=torch.int64),
            scale.reshape(-1).float().contiguous())


def _run(q: torch.Tensor, twin: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    packed, zero_points, weight_scale = twin
    # One row takes a slow path in oneDNN 3.12 when K is small (measured on an AMX Xeon, K = 256:
    # 12.8 ms for N = 4096 against 58 µs for two rows), so one row goes in twice.
    rows = q if q.shape[0] != 1 else q.expand(2, -1).contiguous()
    # x_scale 1: the per-token activation scales are applied by the caller (oneDNN takes one per tensor).
    out = torch.ops.onednn.qlinear_pointwise(rows, 1.0, 0, packed, weight_scale, zero_points,
                                             None, 1.0, 0, torch.float32, "none", [], "")
    return out if q.shape[0] != 1 else out[:1]


ONEDNN = register(PackedKernel("onednn", "oneDNN", _missing, _pack, _run,
                               lambda twin, _qweight: int(twin[0].numel()) * twin[0].element_size()))
