"""FBGEMM's packed int8 GEMM (``opus::fbgemm_int8_linear``; opus.quant.packed has the mechanism).

FBGEMM (in PyTorch's x86 CPU build) multiplies unsigned 8-bit activations by a signed 8-bit weight it
packed once, with AVX-512 VNNI where the CPU has it. At one to a few rows, the decode of one sequence,
it reads the weight near the memory's speed: on the 135M shape's 121 W8A8 layers at one row, 7–8 ms
against 12–13 ms for ``_weight_int8pack_mm`` and oneDNN's packed kernel (Intel Xeon with AMX, 2 threads).

Opus's activations are symmetric int8 per token (SmoothQuant); FBGEMM takes one scale and zero point
for the whole input. So the op hands it the int8 values themselves, as floats (cast in the compiled
graph, fused into the quantization), with scale 1 and zero point 128 (unsigned 1..255 exactly), and the
caller applies the per-token scales, as with oneDNN. The product is then exactly ``_int_mm``'s. Packing
goes through PyTorch's quantized-tensor API, which it has marked deprecated; where a later torch drops
it, ``available()`` says so and the kernel is not raced.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from opus.quant.packed import PackedKernel, register

_OP = "linear_with_input_q_dq_qweight_dq_output_fp32"


def _missing() -> str | None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch has no FBGEMM (PyTorch builds it for x86 CPUs only)"
    if not hasattr(torch.ops.quantized, _OP) or not hasattr(torch.ops.quantized, "linear_prepack"):
        return f"this torch has no FBGEMM int8 linear (quantized.{_OP})"
    return None


def _pack(qweight: torch.Tensor, scale: torch.Tensor) -> Any:
    zero_points = torch.zeros(qweight.shape[0], dtype=torch.int64)
    saved = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"  # the prepack takes the engine's layout; the op reads FBGEMM's
    try:
        with warnings.catch_warnings():  # the quantized-tensor API's deprecation notice (see the module's)
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_channel_quantized_tensor(qweight, scale.reshape(-1).double(), zero_points, 0)
            return torch.ops.quantized.linear_prepack(weight, None)
    finally:
        torch.backends.quantized.engine = saved


def _run(q: torch.Tensor, twin: Any, scale: torch.Tensor) -> torch.Tensor:
    # q: the int8 values as floats (``takes``), cast by the caller's graph.
    return _linear()(q if q.dtype == torch.float32 else q.float(), 1.0, 128, twin)


_LINEAR: list[Any] = []


def _linear() -> Any:
    """FBGEMM's op, looked up once (a namespace lookup per call cost ~1 µs of a ~17 µs call)."""
    if not _LINEAR:
        _LINEAR.append(getattr(torch.ops.quantized, _OP))
    return _LINEAR[0]


def _twin_bytes(_twin: Any, qweight: torch.Tensor) -> int:
    # FBGEMM's blocked copy of the int8 weight, and the quantized weight it keeps to unpack from.
    return 2 * qweight.numel() + 4 * qweight.shape[0]


FBGEMM = register(PackedKernel("fbgemm", "FBGEMM", _missing, _pack, _run, _twin_bytes, takes=torch.float32))
