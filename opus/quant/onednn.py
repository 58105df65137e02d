"""oneDNN's packed int8 GEMM (``opus::onednn_int8_linear``; opus.quant.packed has the mechanism).

oneDNN's ``qlinear`` takes a weight packed once (``onednn.qlinear_prepack``) and is the kernel
PyTorch's own x86 int8 path lowers to; it runs on AMX tiles where the CPU has them. Measured here it
wins at prefill sizes, and loses to FBGEMM (opus.quant.fbgemm) at one to a few rows.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile

import torch

from opus.quant.packed import PackedKernel, register


def _missing() -> str | None:
    if not hasattr(torch.ops.onednn, "qlinear_prepack") or not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN int8 linear (onednn.qlinear_prepack)"
    return None


def _slow() -> str | None:
    implementation = reference_implementation(_verbose_of_one_call())
    if implementation:
        # Measured on an AMD EPYC with AVX-512 VNNI: 67 ms for one 64 x 256 by 384 GEMM (torch._int_mm: ~20 µs);
        # kv_config spent ten minutes timing it in the K3 demo before it lost.
        return (f"oneDNN runs its reference int8 matmul on this CPU ({implementation}: thousands of times slower "
                "than its optimized kernels)")
    return None


def reference_implementation(verbose: str) -> str | None:
    """The implementation oneDNN's verbose lines name for a matmul it ran, where it is a reference one
    (``ref_int8:any``), else None."""
    for line in verbose.splitlines():
        fields = line.split(",")
        if len(fields) > 6 and fields[2:4] == ["primitive", "exec"] and fields[5] == "matmul":
            return fields[6] if fields[6].startswith("ref") else None
    return None


def _verbose_of_one_call() -> str:
    """oneDNN's verbose lines for one small packed GEMM. oneDNN prints them with C stdio on file
    descriptor 1, so that descriptor goes to a temporary file meanwhile (both stdio layers flushed)."""
    qweight = torch.randint(-127, 128, (64, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scale = torch.ones(64)
    twin = _pack(qweight, scale)
    q = qweight[:16].contiguous()
    _run(q, twin, scale)  # the primitive made once, outside the capture
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                _run(q, twin, scale)
        except (RuntimeError, AssertionError):  # a build without verbose mode: no lines, nothing ruled out
            pass
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        return capture.read().decode(errors="replace")


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
                               lambda twin, _qweight: int(twin[0].numel()) * twin[0].element_size(), slow=_slow))
