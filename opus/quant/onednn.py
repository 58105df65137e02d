"""The W8A8 int8 GEMM through oneDNN with the weight packed once: ``opus::onednn_int8_linear``.

``torch._int_mm`` on a CPU hands both operands to oneDNN as plain matrices, so every call reorders
the int8 weight into the blocked layout the VNNI / AMX kernel reads: one more pass over the weight's
bytes per GEMM, which at decode sizes is most of the work. oneDNN's ``qlinear`` takes a weight packed
once (``onednn.qlinear_prepack``), and is the kernel PyTorch's own x86 int8 path lowers to.

The packed weight is an opaque oneDNN tensor, which neither ``torch.compile`` nor ``torch.export``
can hold as a buffer. So the op takes the layer's plain ``qweight`` (an ordinary buffer that graphs
trace) and finds its packed twin in a table keyed by that tensor's identity, packing it on first use;
the twin goes when the weight does. The op is a leaf to the compiler (a fake kernel gives its shape),
so compiled decode steps and prefills call the packed kernel directly.

It is off unless asked for (``use``), which ``available()`` allows where the op is present and agrees
with ``_int_mm`` on a small product. Measured, it saves a pass over the weight per call and costs a fixed
toll per call (a call into Python and oneDNN's argument set-up, some 20-30 µs): big layers win, tiny ones
lose. So the static KV cache's compiled steps take it where ``kv_config`` measured it faster
(``w8a8_packed_gemm``, opus.kv.static), and the eager paths keep ``_int_mm``. The packed twins cost the
int8 weights' bytes once more (``packed_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # qweight → (packed weight, zero points)
_LIB = torch.library.Library("opus", "FRAGMENT")
_LIB.define("onednn_int8_linear(Tensor q, Tensor qweight, Tensor scale) -> Tensor")
_ACTIVE = [False]


def _packed(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    entry = _PACKED.get(qweight)
    if entry is None:
        zero_points = torch.zeros(qweight.shape[0], dtype=torch.int64)
        entry = _PACKED[qweight] = (torch.ops.onednn.qlinear_prepack(qweight, None), zero_points)
    return entry


def _int8_linear_cpu(q: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    packed, zero_points = _packed(qweight)
    # x_scale 1: the per-token activation scales are applied by the caller (oneDNN takes one per tensor).
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, scale.reshape(-1).float(), zero_points,
                                              None, 1.0, 0, torch.float32, "none", [], "")


_LIB.impl("onednn_int8_linear", _int8_linear_cpu, "CPU")


@torch.library.register_fake("opus::onednn_int8_linear", lib=_LIB)
def _int8_linear_shape(q: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], qweight.shape[0]), dtype=torch.float32)


def int8_linear(q: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [M, K] int8 @ qweight [N, K] int8ᵀ`` times the weight's per-channel ``scale``, fp32 ``[M, N]``."""
    return torch.ops.opus.onednn_int8_linear(q, qweight, scale)


@functools.cache
def available() -> str | None:
    """Why the packed oneDNN GEMM cannot serve here, or None when it can (checked against ``_int_mm``)."""
    if not hasattr(torch.ops.onednn, "qlinear_prepack") or not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN int8 linear (onednn.qlinear_prepack)"
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=generator)
    qweight = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=generator)
    scale = torch.rand(48, generator=generator) + 0.5
    try:
        got = _int8_linear_cpu(q, qweight, scale)
    except RuntimeError as error:  # e.g. a CPU oneDNN has no int8 kernel for
        return f"oneDNN's int8 linear failed here: {str(error).splitlines()[0]}"
    finally:
        _PACKED.pop(qweight, None)
    want = torch._int_mm(q, qweight.t()).float() * scale
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-3):
        return "oneDNN's int8 linear disagrees with torch._int_mm here"
    return None


def active() -> bool:
    """Whether W8A8 layers on the CPU take their int8 GEMM from the packed oneDNN kernel now (a compiled
    graph reads this flag when it is traced, and guards on it)."""
    return _ACTIVE[0]


@contextlib.contextmanager
def use(enabled: bool = True) -> Iterator[None]:
    """W8A8 layers on the CPU run their int8 GEMM through the packed oneDNN kernel while this lasts
    (a compiled step reads it when it is traced). Raises ValueError where ``available()`` says no."""
    reason = available() if enabled else None
    if reason is not None:
        raise ValueError(reason)
    saved = _ACTIVE[0]
    _ACTIVE[0] = enabled
    try:
        yield
    finally:
        _ACTIVE[0] = saved


def packed_bytes() -> int:
    """Bytes held by packed weights in this process (their plain twins stay the layers' buffers)."""
    return sum(int(packed.numel()) * packed.element_size() for packed, _ in _PACKED.values())
