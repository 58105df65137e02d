"""W8A8's kernel choices (``Format.kernel_choices``): what the static cache's compiled steps may be traced
under and kv_config races (``kernel_choices: {w8a8_weight_only_rows: [...], w8a8_packed_gemm: [...]}``).

``w8a8_weight_only_rows: N``: W8A8 layers run their weight-only kernel only up to N rows inside the
compiled steps (the layers' default is 16), the int8 GEMM with per-token activations above: which is faster
at a batched decode step depends on the CPU. ``w8a8_packed_gemm``: their int8 GEMMs run through a packed
kernel (opus.quant.packed) instead of ``torch._int_mm``, at ``prefill``, ``decode`` or ``both`` (oneDNN's
there), or a kernel per phase, ``{prefill: onednn, decode: fbgemm}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from opus.kv.kernel_choices import PHASES, KernelChoice
from opus.quant import fbgemm, onednn, packed  # noqa: F401 - importing a kernel registers it

WEIGHT_ONLY_ROWS = "w8a8_weight_only_rows"
PACKED_GEMM = "w8a8_packed_gemm"
PACKED_PHASES = {"prefill": ("prefill",), "decode": ("decode",), "both": PHASES}
OWNER = "W8A8"


def packed_kernels(value: str | dict[str, str] | None) -> dict[str, str]:
    """``{phase: kernel}`` of a ``w8a8_packed_gemm`` value: phases (oneDNN's kernel there) or that mapping."""
    if value is None:
        return {}
    if isinstance(value, str) and value in PACKED_PHASES:
        return dict.fromkeys(PACKED_PHASES[value], "onednn")
    if (isinstance(value, dict) and value and set(value) <= set(PHASES)
            and all(kernel in packed.KERNELS for kernel in value.values())):
        return {phase: value[phase] for phase in PHASES if phase in value}
    raise ValueError(f"{PACKED_GEMM} must be one of {', '.join(PACKED_PHASES)}, or a kernel per phase "
                     f"({{prefill: KERNEL, decode: KERNEL}} with KERNEL one of {', '.join(sorted(packed.KERNELS))}), "
                     f"got {value!r}")


def _describe_packed(value: str | dict[str, str]) -> str:
    if isinstance(value, str):
        return f", packed oneDNN int8 GEMMs at {value}"
    return ", packed int8 GEMMs: " + ", ".join(f"{packed.KERNELS[kernel].label} at {phase}"
                                                for phase, kernel in packed_kernels(value).items())


def _packed_reason(model: nn.Module, value: str | dict[str, str]) -> str | None:
    """Why ``model`` cannot race the packed kernels ``value`` names: off the CPU, missing, wrong or far too
    slow here (a library's reference path)."""
    if next(iter(model.parameters())).device.type != "cpu":
        return "the packed int8 GEMMs run on CPUs"
    for kernel in dict.fromkeys(packed_kernels(value).values()):
        if reason := packed.KERNELS[kernel].race_reason():
            return reason
    return None


def _check_rows(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{WEIGHT_ONLY_ROWS} must be a number of rows, 0 or more, got {value!r}")


def _describe_rows(rows: int) -> str:
    return f", W8A8 int8 GEMMs from {rows + 1} row{'s' if rows else ''}"


def choices(weight_only_up_to: Callable[[int], contextlib.AbstractContextManager[None]],
            applies: Callable[[nn.Module], bool]) -> tuple[KernelChoice, KernelChoice]:
    """The two choices for layers ``applies`` accepts; ``weight_only_up_to(rows)`` sets their threshold."""
    rows = KernelChoice(WEIGHT_ONLY_ROWS, OWNER, weight_only_up_to, applies, _check_rows, _describe_rows)
    packed_gemm = KernelChoice(
        PACKED_GEMM, OWNER, packed.use, applies, packed_kernels, _describe_packed,
        in_phase=lambda value, phase: packed_kernels(value).get(phase),
        names_phases=lambda value: frozenset(packed_kernels(value)), unavailable=_packed_reason)
    return rows, packed_gemm
