"""W4A16: asymmetric int4 weights per group of input channels, bf16 activations (tinygemm-style GEMM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opus.quant.formats.registry import ExportMapping, Format, register
from opus.quant.kernels import dequant_int4, fake_int4_weight, int4_groupwise, unpack_int4
from opus.quant.modules import QuantLinear


@torch.library.custom_op("opus::int4_mm_cpu", mutates_args=())
def int4_mm_cpu(x: torch.Tensor, weight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 weight-only GEMM, as an op inductor calls rather than lowers."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group_size, scales_and_zeros)


@int4_mm_cpu.register_fake
def _int4_mm_cpu_shape(x: torch.Tensor, weight: torch.Tensor, group_size: int,
                       scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class Int4WeightOnlyLinear(QuantLinear):
    """W4A16: asymmetric int4 per group of input channels; tinygemm-style int4 GEMM."""

    fmt = "w4a16"
    OUT_AXES = {"qweight": 0, "scales_and_zeros": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int = 128) -> None:
        super().__init__(in_features, out_features, bias)
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
        self.group_size = group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.zeros(in_features // group_size, out_features, 2))
        self.register_buffer("_kernel_weight", torch.empty(0, dtype=torch.uint8), persistent=False)

    def options(self) -> dict[str, object]:
        return {"group_size": self.group_size}

    def after_load(self) -> None:
        self.repack()

    def load_weight(self, weight: torch.Tensor) -> None:
        self.qweight, self.scales_and_zeros = int4_groupwise(weight, self.group_size)
        self.repack()

    def repack(self) -> None:
        """Convert the portable nibble layout into the device kernel's layout."""
        nibbles = unpack_int4(self.qweight)
        if self.qweight.device.type == "cpu":
            self._kernel_weight = torch._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        else:
            packed = ((nibbles[:, ::2] << 4) | nibbles[:, 1::2]).to(torch.uint8)
            self._kernel_weight = torch._convert_weight_to_int4pack(packed, 8)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module signature
        out = super()._apply(fn, recurse)
        if self._kernel_weight.device != self.qweight.device:
            self.repack()
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            sz = self.scales_and_zeros.to(torch.bfloat16)  # A16, as for int8 weights: bf16 is the fast path
            # Inductor's own lowering of this kernel fails on a computed input (torch 2.13): compiled
            # graphs call it as an opaque op instead.
            kernel = int4_mm_cpu if torch.compiler.is_compiling() else torch.ops.aten._weight_int4pack_mm_for_cpu
            return kernel(x.to(torch.bfloat16), self._kernel_weight, self.group_size, sz).to(x.dtype)
        sz = self.scales_and_zeros.to(x.dtype)
        return torch._weight_int4pack_mm(x.to(torch.bfloat16), self._kernel_weight, self.group_size,
                                         sz.to(torch.bfloat16)).to(x.dtype)


@dataclass(frozen=True)
class Int4Format(Format):
    def unsupported(self, linear: nn.Linear, group_size: int) -> str | None:
        if linear.in_features % group_size or linear.out_features % 16:
            return (f"int4 kernel needs in_features % {group_size} == 0 and out_features % 16 == 0 "
                    f"(layer is {linear.in_features}→{linear.out_features})")
        return None

    def device_unsupported(self, linear: nn.Linear) -> str | None:
        if linear.weight.device.type != "cuda":
            return None
        if linear.weight.dtype != torch.bfloat16:
            return "the CUDA int4 kernel computes in bf16: load the model in bf16"
        if linear.in_features % 128:  # _convert_weight_to_int4pack(innerKTiles=8): K % (8 * 16) == 0
            return f"the CUDA int4 kernel needs in_features % 128 == 0 (layer is {linear.in_features}→...)"
        return None

    def fake_quant_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return fake_int4_weight(weight, group_size)

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        return dequant_int4(module.qweight, module.scales_and_zeros, module.group_size)


# 4.25 bits: one fp32 scale and zero per 128 weights. Asymmetric (scale and zero per group), so the
# GGUF type is the one with per-block minimums (Q4_K). compressed-tensors gets the symmetric W4A16
# scheme: its asymmetric packed zero points do not load in transformers 5.x (llm-compressor#1618,
# transformers#47430), so the HF exporter requantizes each group symmetrically and says so.
register(Int4Format(
    "w4a16", 4.25, rank=10, module=Int4WeightOnlyLinear, uses_group_size=True, static_path=True,
    export=ExportMapping({"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": "from the recipe"},
                          "input_activations": None, "format": "pack-quantized", "preset": "W4A16"},
                         "Q4_K")))
