"""W8A8: int8 per-channel weights and dynamic int8 activations, per token (SmoothQuant) or per tensor."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opus.quant import fbgemm, onednn, packed  # noqa: F401 - importing a kernel registers it
from opus.quant.formats import w8a8_kernels
from opus.quant.formats.registry import ExportMapping, register
from opus.quant.formats.w8a16 import Int8WeightFormat
from opus.quant.kernels import fake_int8_activation, int8_per_tensor, int8_per_token
from opus.quant.modules import Int8WeightLinear, Kernel

INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA: "self.size(0) needs to be greater than 16"


class Int8DynamicLinear(Int8WeightLinear):
    """W8A8: int8 per-channel weights, dynamic int8 activations (per token, or per tensor), int8 GEMM.

    With SmoothQuant the activation outliers have already been migrated into the weights (folded
    into the preceding norm), which is what makes per-token int8 activations accurate.

    Decode-sized inputs (at most ``WEIGHT_ONLY_MAX_ROWS`` rows) skip the activation quantization and
    run the same int8 weights with bf16 activations: below that size quantizing the activations costs
    more than the int8 GEMM saves (measured on CPU: 8x256x384 takes 0.034 ms through ``_int_mm`` and
    0.021 ms through ``_weight_int8pack_mm``; from about 24 rows on the int8 GEMM wins). bf16
    activations are more accurate than int8 ones, so the planner's int8 sensitivity stays an upper bound.
    """

    fmt = "w8a8"
    OUT_AXES = {"qweight": 0, "scale": 1}
    WEIGHT_ONLY_MAX_ROWS = 16

    def __init__(self, in_features: int, out_features: int, bias: bool, per_token: bool = True) -> None:
        # qweight [out, in]: its transpose is the column-major [in, out] operand that ``_int_mm`` reads
        # as fast as a contiguous one (measured) and cuBLASLt requires.
        super().__init__(in_features, out_features, bias, (1, out_features))
        self.per_token = per_token
        if not per_token:
            self.fmt = "w8a8_tensor"

    def options(self) -> dict[str, object]:
        return {"per_token": self.per_token}

    @staticmethod
    def upgrade_tensors(prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        """Older checkpoints and exports stored the weight transposed, as ``qweight_t [in, out]``."""
        old = tensors.pop(f"{prefix}qweight_t", None)
        if old is not None:
            tensors[f"{prefix}qweight"] = old.t().contiguous()

    # Rows per GEMM: a 16k-row prefill in one piece allocates a fresh 50 MB int32 accumulator per call,
    # and its first-touch page faults cost more than the GEMM (measured 3x slower than fp32 on CPU).
    CHUNK_ROWS = 2048

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():  # a symbolic row count: no branch on it
            return self._int8_matmul(x)
        if x.shape[0] <= self.WEIGHT_ONLY_MAX_ROWS:
            return self._weight_only_matmul(x)
        if x.shape[0] <= self.CHUNK_ROWS or packed.active():  # a packed GEMM has no int32 accumulator
            return self._int8_matmul(x)
        out = x.new_empty(x.shape[0], self.out_features)
        for start in range(0, x.shape[0], self.CHUNK_ROWS):
            out[start:start + self.CHUNK_ROWS] = self._int8_matmul(x[start:start + self.CHUNK_ROWS])
        return out

    def _int8_linear(self) -> Callable[..., torch.Tensor]:
        return int8_token_linear if self.per_token else int8_tensor_linear

    def _int8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._int8_linear()(x, self.qweight, self.scale, None)

    def kernel(self, rows: int) -> Kernel | None:
        if rows <= self.WEIGHT_ONLY_MAX_ROWS:
            return None  # the eager layer runs its weight-only branch at this size
        return self._int8_linear(), (self.qweight, self.scale, self.bias)


def _int8_linear(x: torch.Tensor, q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
                 scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = packed.active()
    if kernel is not None and q.device.type == "cpu" and not torch.compiler.is_exporting():
        y = (kernel.linear(q, qweight, scale) * x_scale).to(x.dtype)
    else:
        y = (torch._int_mm(q, qweight.t()) * x_scale).mul_(scale).to(x.dtype)  # int32 × fp32 promotes in one op
    return y if bias is None else y + bias.to(y.dtype)


def int8_token_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 on ``x [M, in]``: per-token int8 activations, the int8 GEMM, both scales (and the bias)."""
    return _int8_linear(x, *int8_per_token(x), qweight, scale, bias)


def int8_tensor_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 with one activation scale for the whole of ``x`` (the naive per-tensor baseline)."""
    return _int8_linear(x, *int8_per_tensor(x), qweight, scale, bias)


@contextlib.contextmanager
def int8_activations_from(rows: int) -> Iterator[None]:
    """W8A8 layers run their weight-only branch only up to ``rows`` rows while this lasts (the layers'
    default: ``WEIGHT_ONLY_MAX_ROWS``): 0 quantizes the activations whatever the row count, as an exported
    graph does (it cannot branch on a symbolic row count). A compiled step reads it when it is traced."""
    saved = Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS
    Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS = rows
    try:
        yield
    finally:
        Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS = saved


def int8_activations_at_every_size() -> contextlib.AbstractContextManager[None]:
    """The eager reference for an export's parity check: int8 activations at every row count."""
    return int8_activations_from(0)


# The static cache's compiled steps may be traced with another threshold and with a packed int8 GEMM,
# oneDNN's or FBGEMM's: the format's kernel choices, which kv_config races.
KERNEL_CHOICES = w8a8_kernels.choices(int8_activations_from, lambda module: isinstance(module, Int8DynamicLinear))


class MinRows(nn.Module):
    """Pads the flattened activation to at least 17 rows (a multiple of 8) around an int8 GEMM.

    ``torch._int_mm`` on CUDA needs more than 16 rows, and ``Int8DynamicLinear`` would run inputs that
    small through its weight-only branch (a dequantized copy of the weight per call on CUDA): padding
    the activation (static shapes) makes the int8 GEMM always run on the static path.
    """

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


def _scheme(activation_strategy: str, preset: str | None) -> dict[str, Any]:
    return {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": activation_strategy, "dynamic": True},
            "format": "int-quantized", "preset": preset}


@dataclass(frozen=True)
class Int8DynamicFormat(Int8WeightFormat):
    """Both operands int8: the 8-bit GEMM's shape rule, and the activations' fake quantization."""

    def unsupported(self, linear: nn.Linear, group_size: int) -> str | None:
        if linear.in_features % 8 or linear.out_features % 8:
            return f"8-bit GEMM needs dimensions divisible by 8 (layer is {linear.in_features}→{linear.out_features})"
        return None

    def fake_quant_input(self, x: torch.Tensor) -> torch.Tensor:
        return fake_int8_activation(x, per_token=self.options["per_token"])

    def wrap_for_static(self, module: nn.Module, device: torch.device) -> nn.Module:
        return MinRows(module) if device.type == "cuda" else module


register(Int8DynamicFormat("w8a8", 8, rank=30, module=Int8DynamicLinear, options={"per_token": True},
                           acts_quantized=True, smoothquant=True, static_path=True, kernel_choices=KERNEL_CHOICES,
                           export_reference=int8_activations_at_every_size,
                           export=ExportMapping(_scheme("token", "W8A8"), "Q8_0")))
# The naive per-tensor baseline, for comparison: not smoothed when applied (it shows what SmoothQuant buys).
register(Int8DynamicFormat("w8a8_tensor", 8, rank=20, module=Int8DynamicLinear, options={"per_token": False},
                           acts_quantized=True, kernel_choices=KERNEL_CHOICES,
                           export_reference=int8_activations_at_every_size,
                           export=ExportMapping(_scheme("tensor", None), "Q8_0")))
