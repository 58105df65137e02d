"""Kernel choices a compiled step may be traced under, owned by the formats that have kernels to choose.

A quantization format declares its choices on itself (``Format.kernel_choices``, as torchao keeps a
kernel's settings on its config): W8A8's weight-only threshold and packed int8 GEMM
(opus.quant.formats.w8a8_kernels). Registering the format registers them here, so the KV caches, which sit
below opus.quant, ask this table and never a format by name: the static cache races each registered
choice that kv_config's ``kernel_choices`` names, carries the chosen value as a cache option of the same
name, and traces its compiled steps under it (opus.kv.compiled_steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

PHASES = ("prefill", "decode")


def _every_phase(value: Any, phase: str) -> Any:
    return value


def _no_phase(value: Any) -> frozenset[str]:
    return frozenset()


def _never_unavailable(model: nn.Module, value: Any) -> str | None:
    return None


@dataclass(frozen=True)
class KernelChoice:
    """One setting a compiled step can be traced under, and everything a cache needs to race it."""

    option: str  # the cache option and kv_config's ``kernel_choices`` key, e.g. ``w8a8_packed_gemm``
    owner: str  # the format whose layers it sets, for messages
    setting: Callable[[Any], contextlib.AbstractContextManager[None]]  # the kernel choice while it lasts
    applies: Callable[[nn.Module], bool]  # a module the setting changes
    check: Callable[[Any], None]  # raises ValueError saying what may be written
    describe: Callable[[Any], str]  # the words a cache's description gives a value (", ...")
    # The value a compiled step of that phase is traced under (None: the layers' default there).
    in_phase: Callable[[Any, str], Any] = _every_phase
    # The phases a value names: a value that names the prefill is raced only with the prefill compiled.
    names_phases: Callable[[Any], frozenset[str]] = _no_phase
    # Why a value cannot run on this model here (beyond having no layer it applies to), or None.
    unavailable: Callable[[nn.Module, Any], str | None] = field(default=_never_unavailable)

    def reason(self, model: nn.Module, value: Any) -> str | None:
        """Why ``model`` cannot be raced with ``value``, or None."""
        if not any(self.applies(m) for m in model.modules()):
            return f"the model has no {self.owner} layer that {self.option} could set"
        return self.unavailable(model, value)


KERNEL_CHOICES: dict[str, KernelChoice] = {}


def register_choice(choice: KernelChoice) -> KernelChoice:
    """Add a choice (a format's registration calls this); an option has one owner."""
    known = KERNEL_CHOICES.get(choice.option)
    if known is not None and known.owner != choice.owner:
        raise ValueError(f"kernel choice '{choice.option}' is {known.owner}'s already")
    KERNEL_CHOICES[choice.option] = choice
    return choice


def choice(option: str) -> KernelChoice:
    """The registered choice named ``option``; a ValueError naming those there are otherwise."""
    if option not in KERNEL_CHOICES:
        raise ValueError(f"no kernel choice '{option}' (registered: {', '.join(KERNEL_CHOICES) or 'none'})")
    return KERNEL_CHOICES[option]


def check_value(option: str, value: Any) -> Any:
    """``value`` for ``option`` when the option is registered and the value valid (None: the default)."""
    if value is not None:
        choice(option).check(value)
    return value


@contextlib.contextmanager
def traced_under(settings: tuple[tuple[str, Any], ...]) -> Iterator[None]:
    """Every registered setting of ``settings`` ((option, value) pairs) in force while it lasts."""
    with contextlib.ExitStack() as stack:
        for option, value in settings:
            if option in KERNEL_CHOICES:
                stack.enter_context(KERNEL_CHOICES[option].setting(value))
        yield
