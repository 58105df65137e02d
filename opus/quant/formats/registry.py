"""The format registry: what a quantization format is, and the table every caller looks formats up in.

A format owns everything about itself — its module class and constructor options, the kernel's shape
constraints, fake quantization for sensitivity scores, whether its activations are quantized, its rung
on the accuracy ladder, how exporters name it and its kernels' choices — so callers ask
``FORMATS[name]`` and never compare names. A format is one module that subclasses ``Format`` and calls
``register``; the built-in ones live beside this file and are imported by the package's ``__init__``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from opus.errors import OpusError
from opus.kv.kernel_choices import KernelChoice, register_choice


@dataclass(frozen=True)
class ExportMapping:
    """How exporters name the format: ``opus.export.hf_compressed`` and ``opus.export.gguf_mix`` read it.

    ``compressed_tensors``: the scheme of a ``quantization_config`` config group (llm-compressor's
    format), None where the layer is stored dense. ``gguf``: the GGUF tensor type, None where GGUF has
    no type for it (an exporter must then dequantize).
    """

    compressed_tensors: Mapping[str, Any] | None = None
    gguf: str | None = None


@dataclass(frozen=True)
class Format:
    """One quantization format. Subclasses override the kernel-specific methods."""

    name: str
    weight_bits: float  # bits per weight in memory, scales included (memory and bits budgets)
    rank: int  # position on the accuracy ladder: lower is less accurate, promotion moves up
    module: type[nn.Module] | None = None  # None: the float nn.Linear is kept as is (the no-op format)
    options: Mapping[str, Any] = field(default_factory=dict)  # constructor options beyond the shape
    uses_group_size: bool = False  # the module takes the plan's group_size (and the recipe records it)
    acts_quantized: bool = False  # activations are quantized too: scored after SmoothQuant by the planner
    smoothquant: bool = False  # apply migrates activation outliers into the weights before quantizing
    cuda_only: bool = False
    static_path: bool = False  # the static CUDA-graph decoder (opus.bench.static_path) may run it
    export: ExportMapping = field(default_factory=ExportMapping)
    # Settings its layers' kernels can be traced under, raced by kv_config (opus.kv.kernel_choices).
    kernel_choices: tuple[KernelChoice, ...] = ()
    # The eager computation an exported graph does (which cannot branch on a symbolic row count): an
    # export's parity check runs the model under it (every registered format's, at once).
    export_reference: Callable[[], contextlib.AbstractContextManager[None]] | None = None

    @property
    def is_noop(self) -> bool:
        """The float layer stays as it is: nothing to build, time against, or record in a recipe."""
        return self.module is None

    def module_options(self, group_size: int) -> dict[str, Any]:
        return {**self.options, "group_size": group_size} if self.uses_group_size else dict(self.options)

    def recipe_options(self, group_size: int) -> dict[str, Any]:
        """What a recipe step records beside the format name to rebuild the layer."""
        return {"group_size": group_size} if self.uses_group_size else {}

    def build(self, linear: nn.Linear, group_size: int) -> nn.Module:
        if self.module is None:
            return linear
        return self.module.from_linear(linear, **self.module_options(group_size))  # type: ignore[attr-defined]

    def empty(self, linear: nn.Linear, group_size: int) -> nn.Module:
        if self.module is None:
            return linear
        module = self.module.empty(linear.in_features, linear.out_features,  # type: ignore[attr-defined]
                                   linear.bias is not None, **self.module_options(group_size))
        return module.to(linear.weight.device)

    def unsupported(self, linear: nn.Linear, group_size: int) -> str | None:
        """Why this format's kernel cannot take this layer's shape, or None."""
        return None

    def device_unsupported(self, linear: nn.Linear) -> str | None:
        """Why the kernel cannot run on this layer's device and dtype (the static GPU path asks)."""
        return None

    def fake_quant_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        """Sensitivity analysis only: the weight as the format would represent it, in float."""
        return weight

    def fake_quant_input(self, x: torch.Tensor) -> torch.Tensor:
        """Sensitivity analysis only: the activation as the kernel would see it."""
        return x

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        """The ``[out, in]`` float weight the built module represents."""
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight
        raise TypeError(f"cannot dequantize {type(module).__name__}")

    def wrap_for_static(self, module: nn.Module, device: torch.device) -> nn.Module:
        """The static (CUDA-graph) path's module: a kernel with limits on static shapes wraps itself."""
        return module


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add a format to the table (a format module calls this at import). Names and ranks are unique."""
    if fmt.name in FORMATS and FORMATS[fmt.name] != fmt:
        raise ValueError(f"format '{fmt.name}' is registered already")
    clash = [f.name for f in FORMATS.values() if f.rank == fmt.rank and f.name != fmt.name]
    if clash:
        raise ValueError(f"format '{fmt.name}' has ladder rank {fmt.rank}, as '{clash[0]}' does")
    if fmt.module is None and any(f.is_noop for f in FORMATS.values() if f.name != fmt.name):
        raise ValueError(f"format '{fmt.name}' keeps the float layer, as '{noop_name()}' does already")
    for kernel_choice in fmt.kernel_choices:
        register_choice(kernel_choice)
    FORMATS[fmt.name] = fmt
    return fmt


@contextlib.contextmanager
def export_reference() -> Iterator[None]:
    """Every registered format computing as its exported graph does, while this lasts."""
    with contextlib.ExitStack() as stack:
        for reference in dict.fromkeys(f.export_reference for f in FORMATS.values() if f.export_reference):
            stack.enter_context(reference())
        yield


def unregister(name: str) -> None:
    """Tests that register a format take it out again."""
    FORMATS.pop(name, None)


def ladder() -> tuple[str, ...]:
    """From least to most accurate: a failed accuracy gate promotes a layer one step up."""
    return tuple(f.name for f in sorted(FORMATS.values(), key=lambda f: f.rank))


def noop_name() -> str:
    """The format that keeps the float layer (fp32): always allowed, the top of the ladder."""
    return next(f.name for f in FORMATS.values() if f.is_noop)


def is_noop(name: str) -> bool:
    """Whether ``name`` keeps the float layer; an unknown name is not (it is treated as quantized)."""
    return name in FORMATS and FORMATS[name].is_noop


def known(*, plannable: bool = False) -> list[str]:
    """Registered names in ladder order; ``plannable``: without the no-op, which is always considered."""
    return [n for n in ladder() if not (plannable and FORMATS[n].is_noop)]


class FormatUnavailable(OpusError, ValueError):
    """A format that is unknown or cannot run on this device: it fails the same way on every attempt."""


def check_format(name: str, device: str) -> Format:
    if name not in FORMATS:
        raise FormatUnavailable(f"unknown format '{name}' (known: {', '.join(FORMATS)})")
    fmt = FORMATS[name]
    if fmt.cuda_only and not device.startswith("cuda"):
        raise FormatUnavailable(f"format '{name}' needs a CUDA device with FP8 support; this model runs on {device}")
    if fmt.cuda_only and torch.cuda.get_device_capability() < (8, 9):
        raise FormatUnavailable(f"format '{name}' needs compute capability 8.9+ (this GPU has "
                         f"{torch.cuda.get_device_capability()})")
    return fmt


def promote(name: str, allowed: list[str]) -> str | None:
    """The next more accurate format among ``allowed`` (the no-op always allowed), or None at the top."""
    steps = ladder()
    for candidate in steps[steps.index(name) + 1:]:
        if candidate in allowed or FORMATS[candidate].is_noop:
            return candidate
    return None


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is a registered format's module (not the float layer it replaced)."""
    classes = tuple(f.module for f in FORMATS.values() if f.module is not None)
    return isinstance(module, classes)
