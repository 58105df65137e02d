"""The kernel settings a static cache's compiled steps are traced under, as cache options.

``w8a8_weight_only_rows: N``: W8A8 layers run their weight-only kernel only up to N rows inside the
compiled steps. ``w8a8_packed_gemm``: their int8 GEMMs run through a packed kernel, per phase
(opus.quant.packed). The settings themselves are registered by their owner, opus.quant's W8A8 format
(``STEP_SETTINGS``), so opus.kv stays below opus.quant.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from opus.kv.compiled_steps import STEP_SETTINGS

WEIGHT_ONLY_ROWS = "w8a8_weight_only_rows"
PACKED_GEMM = "w8a8_packed_gemm"
PACKED_PHASES = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}
PACKED_KERNELS = {"onednn": "oneDNN", "fbgemm": "FBGEMM"}  # the kernels opus.quant.packed registers


def packed_kernels(value: str | dict[str, str] | None) -> dict[str, str]:
    """``{phase: kernel}`` of a ``w8a8_packed_gemm`` value: phases (oneDNN's kernel there) or that mapping."""
    if value is None:
        return {}
    if isinstance(value, str) and value in PACKED_PHASES:
        return dict.fromkeys(PACKED_PHASES[value], "onednn")
    if (isinstance(value, dict) and value and set(value) <= {"prefill", "decode"}
            and all(kernel in PACKED_KERNELS for kernel in value.values())):
        return {phase: value[phase] for phase in ("prefill", "decode") if phase in value}
    raise ValueError(f"w8a8_packed_gemm must be one of {', '.join(PACKED_PHASES)}, or a kernel per phase "
                     f"({{prefill: KERNEL, decode: KERNEL}} with KERNEL one of {', '.join(PACKED_KERNELS)}), "
                     f"got {value!r}")


def describe_packed(value: str | dict[str, str]) -> str:
    """The words a cache's description gives a ``w8a8_packed_gemm`` value."""
    if isinstance(value, str):
        return f", packed oneDNN int8 GEMMs at {value}"
    return ", packed int8 GEMMs: " + ", ".join(f"{PACKED_KERNELS[kernel]} at {phase}"
                                                for phase, kernel in packed_kernels(value).items())


def has_w8a8(model: nn.Module) -> bool:
    """Whether ``model`` has a layer the W8A8 settings apply to."""
    applies = STEP_SETTINGS.get(WEIGHT_ONLY_ROWS, (None, lambda _m: False))[1]
    return any(applies(m) for m in model.modules())


# Why a packed kernel, correct here, should not be raced (a library's reference path): registered by the
# format that packs (opus.quant.formats.w8a8), which sits above this module.
PACKED_RACE_REASON: list[Callable[[str], str | None]] = []


def packed_reason(model: nn.Module, value: str | dict[str, str]) -> str | None:
    """Why ``model`` cannot run the packed kernels ``value`` names, or None."""
    if not has_w8a8(model):
        return "the model has no W8A8 layer whose int8 GEMMs could be packed"
    if next(iter(model.parameters())).device.type != "cpu":
        return "the packed int8 GEMMs run on CPUs"
    for kernel in dict.fromkeys(packed_kernels(value).values()):
        slow = PACKED_RACE_REASON[0](kernel) if PACKED_RACE_REASON else None
        if slow:
            return slow
        try:
            with STEP_SETTINGS[PACKED_GEMM][0](kernel):  # refuses where the kernel is missing or computes wrong
                pass
        except ValueError as error:
            return str(error)
    return None
