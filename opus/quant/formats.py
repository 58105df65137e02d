"""The formats the planner can assign, their modules, weight bits and the accuracy ladder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from opus.quant.kernels import fake_int4_weight, fake_int8_activation, fake_int8_weight
from opus.quant.modules import (
    CastLinear,
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    QuantLinear,
)


@dataclass(frozen=True)
class Format:
    name: str
    weight_bits: float
    module: type[nn.Module] | None  # None: keep the float nn.Linear
    options: dict[str, Any] = field(default_factory=dict)
    cuda_only: bool = False

    def build(self, linear: nn.Linear, group_size: int) -> nn.Module:
        if self.module is None:
            return linear
        return self.module.from_linear(linear, **self._options(group_size))  # type: ignore[attr-defined]

    def empty(self, linear: nn.Linear, group_size: int) -> nn.Module:
        if self.module is None:
            return linear
        module = self.module.empty(linear.in_features, linear.out_features,  # type: ignore[attr-defined]
                                   linear.bias is not None, **self._options(group_size))
        return module.to(linear.weight.device)

    def unsupported(self, linear: nn.Linear, group_size: int) -> str | None:
        """Why this format's kernel cannot take this layer's shape, or None."""
        if self.name == "w4a16" and (linear.in_features % group_size or linear.out_features % 16):
            return (f"int4 kernel needs in_features % {group_size} == 0 and out_features % 16 == 0 "
                    f"(layer is {linear.in_features}→{linear.out_features})")
        if self.name in ("w8a8", "w8a8_tensor", "fp8") and (linear.in_features % 8 or linear.out_features % 8):
            return f"8-bit GEMM needs dimensions divisible by 8 (layer is {linear.in_features}→{linear.out_features})"
        return None

    def _options(self, group_size: int) -> dict[str, Any]:
        return {**self.options, "group_size": group_size} if self.name == "w4a16" else dict(self.options)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("fp32", 32, None),
    Format("bf16", 16, CastLinear, {"dtype": "bfloat16"}),
    Format("fp16", 16, CastLinear, {"dtype": "float16"}),
    Format("w8a16", 8, Int8WeightOnlyLinear),
    Format("w4a16", 4.25, Int4WeightOnlyLinear),  # + one fp32 scale and zero per 128 weights
    Format("w8a8", 8, Int8DynamicLinear),
    Format("w8a8_tensor", 8, Int8DynamicLinear, {"per_token": False}),
    Format("fp8", 8, Fp8Linear, cuda_only=True),
)}

# From least to most accurate: a failed accuracy gate promotes a layer one step up this ladder.
LADDER = ("w4a16", "w8a8_tensor", "w8a8", "fp8", "w8a16", "bf16", "fp16", "fp32")


def check_format(name: str, device: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown format '{name}' (known: {', '.join(FORMATS)})")
    fmt = FORMATS[name]
    if fmt.cuda_only and not device.startswith("cuda"):
        raise ValueError(f"format '{name}' needs a CUDA device with FP8 support; this model runs on {device}")
    if fmt.cuda_only and torch.cuda.get_device_capability() < (8, 9):
        raise ValueError(f"format '{name}' needs compute capability 8.9+ (this GPU has "
                         f"{torch.cuda.get_device_capability()})")
    return fmt


def promote(name: str, allowed: list[str]) -> str | None:
    """The next more accurate format among ``allowed`` (fp32 always allowed), or None at the top."""
    rank = LADDER.index(name)
    for candidate in LADDER[rank + 1:]:
        if candidate in allowed or candidate == "fp32":
            return candidate
    return None


def fake_quant_weight(fmt: str, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sensitivity analysis only: the weight as the format would represent it, in float."""
    if fmt in ("w8a16", "w8a8", "w8a8_tensor"):
        return fake_int8_weight(weight)
    if fmt == "w4a16":
        return fake_int4_weight(weight, group_size)
    if fmt in ("bf16", "fp16"):
        return weight.to(getattr(torch, "bfloat16" if fmt == "bf16" else "float16")).to(weight.dtype)
    if fmt == "fp8":
        return weight.to(torch.float8_e4m3fn).to(weight.dtype)
    return weight


def fake_quant_input(fmt: str, x: torch.Tensor) -> torch.Tensor:
    if fmt == "w8a8":
        return fake_int8_activation(x, per_token=True)
    if fmt == "w8a8_tensor":
        return fake_int8_activation(x, per_token=False)
    return x


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, (QuantLinear, CastLinear))
