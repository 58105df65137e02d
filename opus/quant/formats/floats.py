"""Float formats: fp32 (the no-op: the layer stays as loaded) and bf16/fp16 (the layer cast to 16 bits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opus.quant.formats.registry import ExportMapping, Format, register


class CastLinear(nn.Linear):
    """A float linear kept in another float dtype (bf16/fp16) inside an fp32 model."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str = "bfloat16") -> None:
        super().__init__(in_features, out_features, bias, dtype=getattr(torch, dtype))
        self.fmt = {"bfloat16": "bf16", "float16": "fp16"}[dtype]

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, **options: object) -> CastLinear:
        return cls(in_features, out_features, bias, **options)  # type: ignore[arg-type]

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: object) -> CastLinear:
        module = cls.empty(linear.in_features, linear.out_features, linear.bias is not None, **options)
        module.load_state_dict({k: v.to(module.weight.dtype) for k, v in linear.state_dict().items()})
        return module.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


@dataclass(frozen=True)
class CastFormat(Format):
    """The weight rounded to a 16-bit float; activations are cast at the layer, not quantized."""

    def fake_quant_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return weight.to(getattr(torch, self.options["dtype"])).to(weight.dtype)


register(Format("fp32", 32, rank=100, export=ExportMapping(None, "F32")))
register(CastFormat("bf16", 16, rank=60, module=CastLinear, options={"dtype": "bfloat16"},
                    export=ExportMapping(None, "BF16")))
register(CastFormat("fp16", 16, rank=70, module=CastLinear, options={"dtype": "float16"},
                    export=ExportMapping(None, "F16")))
