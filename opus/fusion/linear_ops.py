"""Merging linear layers: horizontally (q/k/v, gate/up: one GEMM) and stacked (MoE experts).

Only layers of one precision merge. Plain ``nn.Linear`` of one dtype and device is built in; a
quantized-linear class plugs in by registering its own merger::

    @register_concat(Int8Linear)
    def _cat(mods: list[Int8Linear]) -> Int8Linear | str: ...   # a str is the reason to skip

    @register_stacker(Int8Linear)
    def _stack(mods: list[Int8Linear]) -> nn.Module | str: ...  # e.g. a StackedLinear

A mix of classes (some experts quantized, some not) never merges.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from opus.quant.speed import MERGED_EXPERTS_MAX_BYTES

if TYPE_CHECKING:
    from opus.quant.modules import Kernel

Concat = Callable[[list[nn.Module]], "nn.Module | str"]
Stacker = Callable[[list[nn.Module]], "nn.Module | str"]

_CONCAT: dict[type, Concat] = {}
_STACK: dict[type, Stacker] = {}


def register_concat(cls: type) -> Callable[[Concat], Concat]:
    def decorator(fn: Concat) -> Concat:
        _CONCAT[cls] = fn
        return fn
    return decorator


def register_stacker(cls: type) -> Callable[[Stacker], Stacker]:
    def decorator(fn: Stacker) -> Stacker:
        _STACK[cls] = fn
        return fn
    return decorator


def has_concat_rule(module: nn.Module) -> bool:
    """Whether layers of ``module``'s class can be concatenated (a rule is registered for it)."""
    return type(module) in _CONCAT


def _same_class(mods: list[nn.Module]) -> type | str:
    classes = {type(m) for m in mods}
    if len(classes) != 1:
        return "mixed precision: " + ", ".join(sorted(c.__name__ for c in classes))
    return classes.pop()


def concat_linears(mods: list[nn.Module]) -> nn.Module | str:
    """One layer computing ``cat([m(x) for m in mods], -1)``, or the reason it cannot be built."""
    cls = _same_class(mods)
    if isinstance(cls, str):
        return cls
    fn = _CONCAT.get(cls)
    return fn(mods) if fn else f"{cls.__name__}: no concat rule (quantized or custom linear)"


def _plain_check(mods: list[nn.Module]) -> str | None:
    first = mods[0]
    if any(m.weight.dtype != first.weight.dtype or m.weight.device != first.weight.device for m in mods):
        return "mixed precision: " + ", ".join(sorted({str(m.weight.dtype) for m in mods}))
    if len({m.in_features for m in mods}) != 1:
        return "different input sizes"
    if len({m.bias is None for m in mods}) != 1:
        return "bias on some layers only"
    return None


@register_concat(nn.Linear)
def _concat_linear(mods: list[nn.Module]) -> nn.Module | str:
    reason = _plain_check(mods)
    if reason:
        return reason
    first = mods[0]
    out = sum(m.out_features for m in mods)
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, out, bias=first.bias is not None)
    with torch.no_grad():
        grad = first.weight.requires_grad
        fused.weight = nn.Parameter(torch.cat([m.weight for m in mods], 0), requires_grad=grad)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in mods], 0), requires_grad=grad)
    return fused


class StackedLinear(nn.Module):
    """E linears of one shape as one ``[E, out, in]`` weight, run over expert-sorted tokens.

    ``grouped(x, offsets)``: rows ``offsets[e-1]:offsets[e]`` of ``x`` go through expert ``e``.
    Uses ``torch._grouped_mm`` where this build supports it for the device and dtype, else one
    padded ``bmm`` (tokens scattered into ``[E, max_count, in]``) — no Python loop over experts.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, self.bias, offsets)

    def kernel(self, expert: int, rows: int) -> Kernel:
        """Expert ``expert`` as ``F.linear`` and its weight (and bias): QuantLinear.kernel's contract."""
        return F.linear, (self.weight[expert], None if self.bias is None else self.bias[expert])


@register_stacker(nn.Linear)
def _stack_linear(mods: list[nn.Module]) -> StackedLinear | str:
    reason = _plain_check(mods)
    if reason:
        return reason
    if len({(m.out_features, m.in_features) for m in mods}) != 1:
        return "experts of different shapes"
    with torch.no_grad():
        weight = torch.stack([m.weight for m in mods])
        bias = torch.stack([m.bias for m in mods]) if mods[0].bias is not None else None
    return StackedLinear(weight, bias)


def stack_linears(mods: list[nn.Module]) -> nn.Module | str:
    cls = _same_class(mods)
    if isinstance(cls, str):
        return "mixed/quantized experts: not stacked (" + cls + ")"
    fn = _STACK.get(cls)
    if fn is None:
        return f"mixed/quantized experts: not stacked ({cls.__name__} has no stacking rule)"
    return fn(mods)


# -- grouped GEMM ---------------------------------------------------------------------------------
_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}
_GROUPED_WHY: dict[tuple[str, torch.dtype], str] = {}


def grouped_mm_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` cannot run for ``device``'s type and ``dtype``, or None when it can.

    Probed once per (device type, dtype) on unaligned group sizes and checked against per-group
    matmuls: builds and devices differ (CUDA wants bf16 on sm90+, older torch has no such op)."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        why = _probe_grouped_mm(device, dtype)
        _GROUPED_OK[key] = why is None
        if why:
            _GROUPED_WHY[key] = why
    if _GROUPED_OK[key]:
        return None
    return _GROUPED_WHY.get(key, f"torch._grouped_mm switched off for {dtype} on {device.type}")


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return grouped_mm_reason(device, dtype) is None


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=gen).to(device, dtype)
    w = torch.randn(3, 128, 64, generator=gen).to(device, dtype)  # [E, out, in]
    offs = torch.tensor([5, 29, 40], dtype=torch.int32, device=device)  # unaligned group sizes
    try:
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return f"torch._grouped_mm unavailable for {dtype} on {device.type}: {str(e).splitlines()[0]}"
    ref = torch.cat([x[:5] @ w[0].t(), x[5:29] @ w[1].t(), x[29:] @ w[2].t()])
    if not torch.allclose(y.float(), ref.float(), atol=0.2, rtol=0.05):
        return f"torch._grouped_mm gave wrong results for {dtype} on {device.type}"
    return None


@torch.fx.wrap
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   offsets: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` sorted by expert, ``weight [E, out, in]``, ``offsets [E]`` (int32 cumulative ends)."""
    y = None
    if grouped_mm_supported(x.device, x.dtype) and x.shape[0] > 0:
        try:
            y = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        except RuntimeError:  # e.g. CUDA alignment rules for this shape: use the portable path
            y = None
    if y is None:
        y = _padded_bmm(x, weight, offsets)
    if bias is not None:
        expert = torch.bucketize(torch.arange(x.shape[0], device=x.device), offsets.long(), right=True)
        y = y + bias[expert]
    return y


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    num = weight.shape[0]
    ends = offsets.long()
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    counts = ends - starts
    cap = int(counts.max()) if x.shape[0] else 0  # one sync: the padded width
    rows = torch.arange(x.shape[0], device=x.device)
    expert = torch.bucketize(rows, ends, right=True)
    slot = rows - starts[expert]
    buf = x.new_zeros(num, max(cap, 1), x.shape[1])
    buf[expert, slot] = x
    return torch.bmm(buf, weight.transpose(1, 2))[expert, slot]


class StackedQuantLinear(nn.Module):
    """E quantized linears of one class and options, the experts of one MoE layer: ``GroupedExperts``
    runs each expert's own kernels on its contiguous slice of expert-sorted rows (no grouped kernel
    exists for these packed formats), so the unfused loop's per-expert gathers, masks and scatters go."""

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.out_features = experts[0].out_features

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def kernel(self, expert: int, rows: int) -> Kernel | None:
        return self.experts[expert].kernel(rows)

    @property
    def fmt(self) -> str:
        """The experts' format name (``QuantLinear.fmt``), for reasons and summaries."""
        return str(getattr(self.experts[0], "fmt", type(self.experts[0]).__name__))

    def merged(self, max_bytes: int = MERGED_EXPERTS_MAX_BYTES) -> nn.Module | None:
        """All E experts as one layer of their class (outputs concatenated, expert by expert: exact), for
        rows that every expert sees, or None where they do not concatenate or their tensors exceed
        ``max_bytes`` (the planner times the merged GEMM up to the same size: opus.quant.speed). A copy: its
        tensors are kept out of the state dict (derived, not saved)."""
        if sum(t.numel() * t.element_size() for t in self.buffers()) > max_bytes:
            return None
        try:
            merged = concat_linears(list(self.experts))
        except RuntimeError:  # a kernel layout that refuses the merged shape: the calls stay per expert
            return None
        if isinstance(merged, str):
            return None
        for name, tensor in list(merged.named_buffers(recurse=False)):
            delattr(merged, name)
            merged.register_buffer(name, tensor, persistent=False)
        return merged


def _stack_quantized(mods: list[nn.Module]) -> StackedQuantLinear | str:
    if any(m.options() != mods[0].options() for m in mods):
        return "mixed/quantized experts: not stacked (different quantization options)"
    if len({(m.out_features, m.in_features) for m in mods}) != 1:
        return "experts of different shapes"
    return StackedQuantLinear(mods)


def _register_quantized() -> None:
    """Quantized layers of one class and options concatenate exactly along their output axis, and
    stack as a ``StackedQuantLinear``: every registered format's ``QuantLinear`` class."""
    from opus.quant.formats import FORMATS
    from opus.quant.modules import QuantLinear, concat_quantized

    for fmt in FORMATS.values():
        if fmt.module is not None and issubclass(fmt.module, QuantLinear):
            register_concat(fmt.module)(concat_quantized)
            register_stacker(fmt.module)(_stack_quantized)


_register_quantized()
