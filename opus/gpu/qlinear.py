"""Linear layers for the static path: fusing float linears, and quantizing them with opus.quant formats.

Formats (``opus.quant.formats``): ``fp8`` (E4M3 weights, rowwise-scaled activations, ``torch._scaled_mm``,
CUDA sm_89+), ``w8a8`` (int8 per-channel weights, per-token int8 activations, ``torch._int_mm``) and
``w4a16`` (int4 per group, ``_weight_int4pack_mm``). Two CUDA details are handled here rather than in
opus.quant (which this package does not own):

* ``torch._int_mm`` on CUDA needs more than 16 rows, and ``Int8DynamicLinear`` would run inputs that
  small through its weight-only branch (a dequantized copy of the weight per call on CUDA): ``MinRows``
  pads the activation (static shapes) so the int8 GEMM always runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from opus.quant.formats import FORMATS
from opus.quant.kernels import dequant_int4
from opus.quant.modules import Fp8Linear, Int4WeightOnlyLinear, Int8DynamicLinear, QuantLinear

QUANT_FORMATS = ("fp8", "w8a8", "w4a16")
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA: "self.size(0) needs to be greater than 16"


class MinRows(nn.Module):
    """Pads the flattened activation to at least 17 rows (a multiple of 8) around an int8 GEMM."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        if rows >= INT_MM_MIN_ROWS:
            return self.inner(x)
        padded = F.pad(flat, (0, 0, 0, 24 - rows))  # 24: the first multiple of 8 above 16
        return self.inner(padded)[:rows].reshape(*x.shape[:-1], -1)


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``linears``' outputs (same input)."""
    first = linears[0]
    out = sum(lin.out_features for lin in linears)
    has_bias = any(lin.bias is not None for lin in linears)
    with torch.no_grad():
        fused = nn.Linear(first.in_features, out, bias=has_bias, device=first.weight.device,
                          dtype=first.weight.dtype)
        fused.weight.copy_(torch.cat([lin.weight for lin in linears], dim=0))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                                        for lin in linears]))
    fused.requires_grad_(False)
    return fused


def linear_from_weight(weight: torch.Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` holding ``weight`` ([out, in]) without copying it."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def group_size_for(in_features: int) -> int:
    """The largest int4 group size (128, 64, 32) dividing ``in_features``."""
    return next((g for g in (128, 64, 32) if in_features % g == 0), 128)


def quant_reason(fmt: str, linear: nn.Linear) -> str | None:
    """Why ``fmt`` cannot run on ``linear`` here, or None."""
    if fmt not in QUANT_FORMATS:
        return f"unknown format {fmt!r} (static path supports {', '.join(QUANT_FORMATS)})"
    device = linear.weight.device
    if fmt == "fp8":
        if device.type != "cuda":
            return None if _cpu_scaled_mm_works() else "fp8 needs CUDA (torch._scaled_mm rowwise)"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return f"fp8 needs compute capability 8.9+ (this GPU: {torch.cuda.get_device_capability(device)})"
    if fmt == "w4a16" and device.type == "cuda":
        if linear.weight.dtype != torch.bfloat16:
            return "the CUDA int4 kernel computes in bf16: load the model in bf16"
        if linear.in_features % 128:  # _convert_weight_to_int4pack(innerKTiles=8): K % (8 * 16) == 0
            return f"the CUDA int4 kernel needs in_features % 128 == 0 (layer is {linear.in_features}→...)"
    return FORMATS[fmt].unsupported(linear, group_size_for(linear.in_features))


@functools.cache
def _cpu_scaled_mm_works() -> bool:
    """Recent torch runs rowwise ``_scaled_mm`` on CPU too: then the fp8 path can be tested there."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        scale = torch.ones(16, 1)
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    return True


def quantize_linear(linear: nn.Linear, fmt: str | None) -> tuple[nn.Module, str | None]:
    """``(module, note)``: the quantized replacement, or ``linear`` itself and the reason it was kept."""
    if fmt is None:
        return linear, None
    reason = quant_reason(fmt, linear)
    if reason:
        return linear, reason
    with torch.no_grad():
        module = FORMATS[fmt].build(linear, group_size_for(linear.in_features))
    module.requires_grad_(False)
    if isinstance(module, Int8DynamicLinear) and linear.weight.device.type == "cuda":
        return MinRows(module), None
    return module, None


def dequantize(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` float weight a (possibly quantized) linear represents (fp32 for quantized ones)."""
    if isinstance(module, MinRows):
        return dequantize(module.inner)
    if isinstance(module, nn.Linear):
        return module.weight
    if isinstance(module, (Fp8Linear, Int8DynamicLinear)):
        return module.qweight.float() * module.scale.reshape(-1, 1)
    if isinstance(module, Int4WeightOnlyLinear):
        return dequant_int4(module.qweight, module.scales_and_zeros, module.group_size)
    raise TypeError(f"cannot dequantize {type(module).__name__}")


def format_of(module: nn.Module) -> str:
    if isinstance(module, MinRows):
        return format_of(module.inner)
    if isinstance(module, QuantLinear):
        return module.fmt
    return str(module.weight.dtype).replace("torch.", "") if isinstance(module, nn.Linear) else "?"


def module_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and buffers a module holds (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
