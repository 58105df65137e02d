"""W8A8's int8 GEMM through a kernel that reads its weight packed once: oneDNN's or FBGEMM's.

``torch._int_mm`` on a CPU hands both operands to oneDNN as plain matrices, so every call reorders the
int8 weight into the blocked layout the VNNI / AMX kernel reads: one more pass over the weight's bytes
per GEMM, which at decode sizes is most of the work. A packed kernel takes a twin of the weight laid
out once. Two libraries in PyTorch's CPU build have one: oneDNN (``opus.quant.onednn``; AMX where the
CPU has it, strong at prefill sizes) and FBGEMM (``opus.quant.fbgemm``; AVX-512 VNNI, strong at one to
a few rows, where it reads the weight near the memory's speed).

A packed weight is an opaque library object, which neither ``torch.compile`` nor ``torch.export`` can
hold as a buffer. So each kernel is a custom op, ``opus::<kernel>_int8_linear(q, qweight, scale)``,
that takes the layer's plain ``qweight`` (an ordinary buffer that graphs trace) and finds its packed
twin in a table keyed by that tensor's identity, packing it on first use; the twin goes when the
weight does. The op is a leaf to the compiler (a fake kernel gives its shape), so compiled decode
steps and prefills call the packed kernel directly.

None is on unless asked for (``use``), which ``available()`` allows where the library has the kernel
and it agrees exactly with ``_int_mm`` on a product whose pairs reach the int8 extremes (a kernel that
saturates 16-bit pair sums, as AVX2's ``vpmaddubsw`` does, fails it). Each call costs a fixed toll (the
library's argument set-up, and a call into Python where opus.quant.cpp_kernels's C++ kernels are not built),
so big layers win and tiny ones lose: the static KV cache's compiled steps take a kernel per phase
where ``kv_config`` measured it faster (``w8a8_packed_gemm``, opus.kv.static); the eager paths and
exports keep ``_int_mm``. The twins cost the int8 weights' bytes once more per kernel, FBGEMM's twice
(``packed_bytes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from opus.quant import cpp_kernels

_LIB = torch.library.Library("opus", "FRAGMENT")
_ACTIVE: list[str | None] = [None]


@dataclass
class PackedKernel:
    """One library's packed int8 GEMM: ``run(q, twin) -> fp32 [M, N]`` times the weight's scales."""

    name: str  # onednn | fbgemm: the op is opus::<name>_int8_linear
    label: str  # as a person names the library
    missing: Callable[[], str | None]  # why this torch lacks the kernel, or None
    pack: Callable[[torch.Tensor, torch.Tensor], Any]  # (qweight [N, K] int8, scale) -> twin
    run: Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]  # (q [M, K] as ``takes``, twin, scale) -> fp32
    twin_bytes: Callable[[Any, torch.Tensor], int]  # (twin, qweight) -> bytes it holds
    # The dtype ``run`` takes the int8 values in: a kernel that wants floats (FBGEMM's quantizes them itself)
    # gets them cast inside the compiled graph, where the cast fuses into the quantization kernel.
    takes: torch.dtype = torch.int8
    # Why this kernel, correct here, is not worth racing (a library's reference path), or None.
    slow: Callable[[], str | None] = lambda: None
    twins: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # qweight -> twin
    checked: list[str | None] = field(default_factory=list)  # available()'s, then race_reason()'s answer

    def twin(self, qweight: torch.Tensor, scale: torch.Tensor) -> Any:
        entry = self.twins.get(qweight)
        if entry is None:
            entry = self.twins[qweight] = self.pack(qweight, scale)
        return entry

    def python_kernel(self, q: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The op's kernel in Python (where opus.quant.cpp_kernels's C++ one is not built): the twin, then ``run``."""
        return self.run(q, self.twin(qweight, scale), scale)

    def linear(self, q: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``q [M, K] int8 @ qweight [N, K] int8ᵀ`` times the weight's per-channel ``scale``, fp32 ``[M, N]``."""
        if not torch.compiler.is_compiling():  # a compiled graph was traced under use(), which placed it
            _kernel_in_place(self)
        return getattr(torch.ops.opus, f"{self.name}_int8_linear")(q.to(self.takes), qweight, scale)

    def available(self) -> str | None:
        """Why this kernel cannot serve here, or None when it can (checked against ``_int_mm``)."""
        if not self.checked:
            self.checked.append(self._check())
        return self.checked[0]

    def race_reason(self) -> str | None:
        """Why a race of kernels should leave this one out: unavailable, or correct but far too slow here."""
        if len(self.checked) < 2:
            self.checked.append(self.available() or self.slow())
        return self.checked[1]

    def _check(self) -> str | None:
        reason = self.missing()
        if reason is not None:
            return reason
        generator = torch.Generator().manual_seed(0)
        q = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=generator)
        qweight = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=generator)
        q[0], qweight[0], qweight[1] = 127, 127, -127  # pairs at the extremes: 16-bit saturation shows
        scale = torch.rand(48, generator=generator) + 0.5
        try:
            got = self.run(q.to(self.takes), self.pack(qweight, scale), scale)
        except RuntimeError as error:  # e.g. a CPU the library has no int8 kernel for
            return f"{self.label}'s int8 linear failed here: {str(error).splitlines()[0]}"
        want = torch._int_mm(q, qweight.t()).float() * scale
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-3):
            return f"{self.label}'s int8 linear disagrees with torch._int_mm here"
        return None


KERNELS: dict[str, PackedKernel] = {}


def register(kernel: PackedKernel) -> PackedKernel:
    """Define ``opus::<name>_int8_linear`` for ``kernel`` (CPU, and its shape for the compiler), with a
    Python kernel that opus.quant.cpp_kernels's C++ one replaces once built; and ``opus::<name>_pack``, how
    that C++ kernel has a weight packed the first time it meets it."""
    op = f"{kernel.name}_int8_linear"
    _LIB.define(f"{op}(Tensor q, Tensor qweight, Tensor scale) -> Tensor")  # its CPU kernel: _kernel_in_place
    _LIB.define(f"{kernel.name}_pack(Tensor qweight, Tensor scale) -> ()")
    _LIB.impl(f"{kernel.name}_pack",
              lambda qweight, scale: cpp_kernels.remember(kernel.name, qweight, kernel.twin(qweight, scale)), "CPU")
    torch.library.register_fake(f"opus::{op}", lib=_LIB)(
        lambda q, qweight, scale: q.new_empty((q.shape[0], qweight.shape[0]), dtype=torch.float32))
    KERNELS[kernel.name] = kernel
    return kernel


_PLACED: set[str] = set()


def _kernel_in_place(kernel: PackedKernel) -> None:
    """The CPU kernel of ``opus::<name>_int8_linear``: opus.quant.cpp_kernels's C++ one where it builds, else the
    Python one, registered then (registering it first would have the C++ one override it, with a warning)."""
    if kernel.name in _PLACED:
        return
    if cpp_kernels.load() is not None:
        _LIB.impl(f"{kernel.name}_int8_linear", kernel.python_kernel, "CPU")
    _PLACED.add(kernel.name)


def kernel_named(name: str) -> PackedKernel:
    if name not in KERNELS:
        raise ValueError(f"no packed int8 GEMM named {name!r}; there are {', '.join(sorted(KERNELS))}")
    return KERNELS[name]


def active() -> PackedKernel | None:
    """The packed kernel W8A8 layers on the CPU take their int8 GEMM from now, if any (a compiled graph
    reads this when it is traced, and guards on it)."""
    return KERNELS[_ACTIVE[0]] if _ACTIVE[0] else None


@contextlib.contextmanager
def use(kernel: str | None) -> Iterator[None]:
    """W8A8 layers on the CPU run their int8 GEMM through ``kernel``'s packed op while this lasts (None:
    through none). Raises ValueError where ``available()`` says no."""
    if kernel is not None:
        reason = kernel_named(kernel).available()
        if reason is not None:
            raise ValueError(reason)
        _kernel_in_place(kernel_named(kernel))
    saved = _ACTIVE[0]
    _ACTIVE[0] = kernel
    try:
        yield
    finally:
        _ACTIVE[0] = saved


def packed_bytes() -> int:
    """Bytes held by packed twins in this process, every kernel (the plain weights stay the layers')."""
    return sum(kernel.twin_bytes(twin, qweight) for kernel in KERNELS.values()
               for qweight, twin in list(kernel.twins.items()))
