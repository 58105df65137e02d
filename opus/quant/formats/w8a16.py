"""W8A16: int8 weights per output channel, bf16 activations (the weight-only int8 GEMM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opus.quant.formats.registry import ExportMapping, Format, register
from opus.quant.kernels import fake_int8_weight
from opus.quant.modules import Int8WeightLinear


class Int8WeightOnlyLinear(Int8WeightLinear):
    """W8A16: int8 weights per output channel, bf16 activations."""

    fmt = "w8a16"
    OUT_AXES = {"qweight": 0, "scale": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias, (out_features,))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._weight_only_matmul(x)


@dataclass(frozen=True)
class Int8WeightFormat(Format):
    """Int8 per-channel weights (shared by W8A8, whose weights are the same): their fake quantization."""

    def fake_quant_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return fake_int8_weight(weight)

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        return module.qweight.float() * module.scale.reshape(-1, 1)


register(Int8WeightFormat(
    "w8a16", 8, rank=50, module=Int8WeightOnlyLinear,
    export=ExportMapping({"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                          "input_activations": None, "format": "pack-quantized", "preset": "W8A16"}, "Q8_0")))
