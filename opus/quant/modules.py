"""Quantized replacements for ``nn.Linear`` that run real low-precision kernels.

Every module can be built empty from shapes (``empty``), so a checkpoint rebuilds the structure from
its recipe and then loads the packed tensors; ``from_linear`` quantizes a float layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from opus.quant.kernels import fp8_rowwise, int4_groupwise, int8_per_channel, int8_per_tensor, int8_per_token


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
        if x.device.type == "cpu":
            # A16: the CPU kernel is 10-30x faster with bf16 than with fp32 activations (measured).
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self._scale_bf16).to(x.dtype)
        # CUDA has no int8-weight GEMM in torch: convert in the GEMM's prologue (int8 storage).
        return (x @ self.qweight.to(x.dtype).t()) * self.scale.to(x.dtype)


class Int8WeightOnlyLinear(Int8WeightLinear):
    """W8A16: int8 weights per output channel, bf16 activations."""

    fmt = "w8a16"
    OUT_AXES = {"qweight": 0, "scale": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias, (out_features,))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._weight_only_matmul(x)


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
        from opus.quant.kernels import unpack_int4

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
        if x.shape[0] <= self.CHUNK_ROWS:
            return self._int8_matmul(x)
        out = x.new_empty(x.shape[0], self.out_features)
        for start in range(0, x.shape[0], self.CHUNK_ROWS):
            out[start:start + self.CHUNK_ROWS] = self._int8_matmul(x[start:start + self.CHUNK_ROWS])
        return out

    def _int8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        q, x_scale = int8_per_token(x) if self.per_token else int8_per_tensor(x)
        acc = torch._int_mm(q, self.qweight.t())
        return (acc * x_scale).mul_(self.scale).to(x.dtype)  # int32 × fp32 promotes in one op


@contextlib.contextmanager
def int8_activations_at_every_size() -> Iterator[None]:
    """W8A8 layers quantize their activations whatever the row count, as an exported graph does (it
    cannot branch on a symbolic row count): the eager reference for an export's parity check."""
    saved = Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS
    Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS = 0
    try:
        yield
    finally:
        Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS = saved


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


