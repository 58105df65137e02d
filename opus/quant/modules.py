"""The shared base of the quantized replacements for ``nn.Linear`` that run real low-precision kernels.

Every module can be built empty from shapes (``empty``), so a checkpoint rebuilds the structure from
its recipe and then loads the packed tensors; ``from_linear`` quantizes a float layer. Each format's
own class lives in its format module (``opus.quant.formats.<family>``); the old names here still
resolve (``__getattr__`` below), for code written against this module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from opus.quant.kernels import int8_per_channel

Kernel = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor | None, ...]]


class QuantLinear(nn.Module):
    """Shared plumbing: shapes, optional float bias, flattening of leading dimensions."""

    fmt = "float"
    # Buffer name -> the axis that indexes output features: layers of one class and options can be
    # concatenated along it (q/k/v into one GEMM) without requantizing anything.
    OUT_AXES: dict[str, int] = {}

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.register_load_state_dict_post_hook(lambda module, _: module.after_load())

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # An expert that no token was routed to gets an empty input; not every kernel accepts one.
        # (Exporters trace with symbolic row counts: no branch on them there.)
        if torch.compiler.is_compiling() or flat.shape[0]:
            y = self.matmul(flat)
        else:
            y = flat.new_zeros(0, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def options(self) -> dict[str, object]:
        """Constructor options beyond the shape (what ``empty`` needs to rebuild this layer)."""
        return {}

    def kernel(self, rows: int) -> Kernel | None:
        """A pure function and its tensors, ``fn(x, *tensors)``, computing this layer (bias included) on
        a ``[rows, in]`` input, for callers that compile it with their own ops around it (the compiled
        MoE experts); None where this format has none or would run another path at that row count."""
        return None

    def after_load(self) -> None:
        """Re-derive kernel layouts after the packed tensors changed."""

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, **options: object) -> QuantLinear:
        return cls(in_features, out_features, bias, **options)  # type: ignore[arg-type]

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: object) -> QuantLinear:
        module = cls.empty(linear.in_features, linear.out_features, linear.bias is not None, **options)
        module.load_weight(linear.weight.detach())
        if linear.bias is not None and module.bias is not None:
            module.bias.data.copy_(linear.bias.detach().float())
        return module.to(linear.weight.device)

    def load_weight(self, weight: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class Int8WeightLinear(QuantLinear):
    """Int8 weights per output channel, ``qweight [out, in]`` and ``scale``, and the weight-only GEMM
    over them with bf16 activations (``_weight_int8pack_mm`` on CPU): W8A16, and W8A8 at decode sizes."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scale_shape: tuple[int, ...]) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(scale_shape))
        # The CPU kernel takes bf16 scales: derived once here, not converted on every call.
        self.register_buffer("_scale_bf16", torch.ones(out_features, dtype=torch.bfloat16), persistent=False)

    def after_load(self) -> None:
        self._scale_bf16 = self.scale.reshape(-1).to(torch.bfloat16)

    def load_weight(self, weight: torch.Tensor) -> None:
        self.qweight, scale = int8_per_channel(weight)
        self.scale = scale.reshape(self.scale.shape)
        self.after_load()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module signature
        out = super()._apply(fn, recurse)
        self.after_load()  # a dtype cast of the module must not reach the kernel's bf16 scales
        return out

    def _weight_only_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # torch 2.13's CPU kernel reads past the weight when in_features is not a multiple of 16
        # (measured: K = 8, 24, 40, 56, 72 returned garbage or crashed); such layers dequantize instead.
        if x.device.type == "cpu" and self.in_features % 16 == 0:
            # A16: the CPU kernel is 10-30x faster with bf16 than with fp32 activations (measured).
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self._scale_bf16).to(x.dtype)
        # CUDA has no int8-weight GEMM in torch: convert in the GEMM's prologue (int8 storage).
        return (x @ self.qweight.to(x.dtype).t()) * self.scale.to(x.dtype)


def concat_quantized(mods: list[QuantLinear]) -> QuantLinear | str:
    """One layer of the same class computing ``cat([m(x) for m in mods], -1)``, or why not."""
    first = mods[0]
    if any(m.options() != first.options() for m in mods):
        return "different quantization options"
    if len({m.in_features for m in mods}) != 1:
        return "different input sizes"
    if len({m.bias is None for m in mods}) != 1:
        return "bias on some layers only"
    out = sum(m.out_features for m in mods)
    fused = type(first).empty(first.in_features, out, first.bias is not None, **first.options())
    with torch.no_grad():
        for name, axis in type(first).OUT_AXES.items():
            setattr(fused, name, torch.cat([getattr(m, name) for m in mods], dim=axis))
        if first.bias is not None:
            fused.bias.data = torch.cat([m.bias.data for m in mods])
    fused.after_load()
    return fused.to(next(first.buffers()).device)


# Moved to their format modules; resolved lazily, since those modules import this one for the base.
_MOVED = {
    "Int8WeightOnlyLinear": "opus.quant.formats.w8a16",
    "Int8DynamicLinear": "opus.quant.formats.w8a8",
    "int8_activations_at_every_size": "opus.quant.formats.w8a8",
    "Int4WeightOnlyLinear": "opus.quant.formats.w4a16",
    "int4_mm_cpu": "opus.quant.formats.w4a16",
    "Fp8Linear": "opus.quant.formats.fp8",
    "CastLinear": "opus.quant.formats.floats",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
