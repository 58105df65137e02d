"""Linear layers for the static path: fusing float linears, and quantizing them with opus.quant formats.

Formats (``opus.quant.formats``) whose ``static_path`` is set run here — today ``fp8`` (E4M3 weights,
rowwise-scaled activations, ``torch._scaled_mm``, CUDA sm_89+), ``w8a8`` (int8 per-channel weights,
per-token int8 activations, ``torch._int_mm``) and ``w4a16`` (int4 per group, ``_weight_int4pack_mm``).
Each format owns its device rules (``device_unsupported``) and its static-shape wrapper
(``wrap_for_static``: W8A8 pads small row counts for ``torch._int_mm`` on CUDA, ``MinRows``).
"""

from __future__ import annotations

import torch
from torch import nn

from opus.quant.formats import FORMATS
from opus.quant.formats.w8a8 import INT_MM_MIN_ROWS, MinRows
from opus.quant.modules import QuantLinear

__all__ = ["INT_MM_MIN_ROWS", "MinRows", "dequantize", "format_of", "fuse_linears", "group_size_for",
           "linear_from_weight", "module_bytes", "quant_reason", "quantize_linear", "static_formats"]


def static_formats() -> list[str]:
    """The registered formats the static path can run."""
    return [name for name, fmt in FORMATS.items() if fmt.static_path]


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
    if fmt not in FORMATS or not FORMATS[fmt].static_path:
        return f"unknown format {fmt!r} (static path supports {', '.join(static_formats())})"
    found = FORMATS[fmt]
    return found.device_unsupported(linear) or found.unsupported(linear, group_size_for(linear.in_features))


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
    return FORMATS[fmt].wrap_for_static(module, linear.weight.device), None


def dequantize(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` float weight a (possibly quantized) linear represents (fp32 for quantized ones)."""
    if isinstance(module, MinRows):
        return dequantize(module.inner)
    if isinstance(module, nn.Linear):
        return module.weight
    fmt = FORMATS.get(getattr(module, "fmt", ""))
    if fmt is None:
        raise TypeError(f"cannot dequantize {type(module).__name__}")
    return fmt.dequantize(module)


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
