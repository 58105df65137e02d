"""FP8: E4M3 weights per output channel and rowwise-scaled E4M3 activations (``torch._scaled_mm``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from opus.quant.formats.registry import ExportMapping, Format, register
from opus.quant.kernels import fp8_rowwise
from opus.quant.modules import QuantLinear


class Fp8Linear(QuantLinear):
    """FP8 E4M3 weights and rowwise-scaled activations through ``torch._scaled_mm`` (CUDA sm_89+)."""

    fmt = "fp8"
    OUT_AXES = {"qweight": 0, "scale": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.ones(1, out_features))

    def load_weight(self, weight: torch.Tensor) -> None:
        q, scale = fp8_rowwise(weight)
        self.qweight, self.scale = q, scale.reshape(1, -1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        q, x_scale = fp8_rowwise(x)
        return torch._scaled_mm(q, self.qweight.t(), scale_a=x_scale, scale_b=self.scale,
                                out_dtype=torch.bfloat16).to(x.dtype)


@functools.cache
def cpu_scaled_mm_works() -> bool:
    """Recent torch runs rowwise ``_scaled_mm`` on CPU too: then the fp8 path can be tested there."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        scale = torch.ones(16, 1)
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    return True


@dataclass(frozen=True)
class Fp8Format(Format):
    def unsupported(self, linear: nn.Linear, group_size: int) -> str | None:
        if linear.in_features % 8 or linear.out_features % 8:
            return f"8-bit GEMM needs dimensions divisible by 8 (layer is {linear.in_features}→{linear.out_features})"
        return None

    def device_unsupported(self, linear: nn.Linear) -> str | None:
        device = linear.weight.device
        if device.type != "cuda":
            return None if cpu_scaled_mm_works() else "fp8 needs CUDA (torch._scaled_mm rowwise)"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return f"fp8 needs compute capability 8.9+ (this GPU: {torch.cuda.get_device_capability(device)})"
        return None

    def fake_quant_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        # A plain cast, as the planner always scored it (the kernel's rowwise scale is finer than this).
        return weight.to(torch.float8_e4m3fn).to(weight.dtype)

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        return module.qweight.float() * module.scale.reshape(-1, 1)


register(Fp8Format(
    "fp8", 8, rank=40, module=Fp8Linear, acts_quantized=True, smoothquant=True, cuda_only=True, static_path=True,
    export=ExportMapping({"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                          "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                "strategy": "token", "dynamic": True},
                          "format": "float-quantized", "preset": "FP8_DYNAMIC"},
                         None)))  # GGUF has no FP8 tensor type: an exporter dequantizes (to BF16)
