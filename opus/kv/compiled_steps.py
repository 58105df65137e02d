"""Compiling a model's steps (a decode step, a padded prefill) into one C++ graph each, once per model.

The static KV cache (opus.kv.static) and the server's decode steps (opus.serve.steps) run their steps
through here. A compiled step is traced under its kernel settings (opus.kv.kernel_choices: W8A8's
weight-only threshold and packed GEMM, declared by the format that owns the kernel) and falls back to
its eager step, once, if compiling fails; the reasons are kept in ``NOTES``.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opus import compile_watch
from opus.kv.kernel_choices import KERNEL_CHOICES, traced_under

RECOMPILE_LIMIT = 32
Step = Callable[..., torch.Tensor]
Steps = weakref.WeakKeyDictionary[nn.Module, dict[str, Step]]  # per model, per attention kernel and settings
EagerStep = Callable[[nn.Module, str], Step]
StepKey = tuple[tuple[str, Any], ...]  # the settings a compiled step is traced under, (option, value)
NOTES: list[str] = []  # compile fallbacks of this process, one line each
_SERIAL = itertools.count()


def compiled_once(model: nn.Module, attention: str, settings: StepKey, steps: Steps, eager: EagerStep,
                  what: str) -> Step:
    """``eager(model, attention)`` compiled, kept in ``steps`` per model, kernel and settings."""
    own = steps.setdefault(model, {})
    key = ", ".join([attention, *(f"{option} {value}" for option, value in settings)])
    if key not in own:
        compiled = _traced_with(settings, compile_step(eager(model, attention)))
        own[key] = _with_fallback(model, attention, key, compiled, own, eager, what)
    return own[key]


def _traced_with(settings: StepKey, compiled: Step) -> Step:
    """``compiled`` always called (and so traced) under ``settings``' kernel choices (W8A8's weight-only
    threshold, its packed GEMM): the graph keeps the branch it was traced with."""
    if not any(option in KERNEL_CHOICES for option, _ in settings):  # no format with choices registered
        return compiled

    def step(*args: Any) -> torch.Tensor:
        with traced_under(settings):
            return compiled(*args)

    return step


def compile_step(fn: Step, dynamic: bool | None = False) -> Step:
    """``fn`` (a step of one frozen model) compiled into one C++ graph per input shape.

    No guards on the model's modules: checking them cost ~0.16 ms per K3 step, an eighth of the
    step. Safe here: a compiled step belongs to one model, whose weights are frozen; shapes and
    dtypes of the step's tensors are still guarded (a new batch size or slot count recompiles, unless
    the dimension was marked dynamic). Without those guards, dynamo would hand one model's graph to
    another model's step (compiled code is cached per code object): each step gets a code object of
    its own. ``dynamic``: as torch.compile's (None lets ``mark_dynamic`` dimensions stay symbolic).
    """
    options = {"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    # One graph per (batch, bucket, slots, K/V dtype): a process that measures several caches (kv_config,
    # the benches) passes dynamo's default of 8 graphs per step, and fullgraph then fails to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compile_watch.watch()
    return torch.compile(_own_code(fn), fullgraph=True, dynamic=dynamic, options=options)


def _own_code(fn: Step) -> Step:
    """``fn`` with a copy of its code object (dynamo's cache of compiled graphs hangs off the code)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_SERIAL)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _with_fallback(model: nn.Module, attention: str, key: str, compiled: Step, own: dict[str, Step],
                   eager: EagerStep, what: str) -> Step:
    """``compiled``, or — if compiling fails — the eager step from then on, with the reason in NOTES."""
    def step(*args: Any) -> torch.Tensor:
        try:
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - no C++ compiler, an op inductor cannot lower
            NOTES.append(f"{type(model).__name__}: {what} not compiled, runs eagerly: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            own[key] = eager(model, attention)
            return own[key](*args)

    return step


def compile_notes() -> list[str]:
    """This process's compile fallbacks, each once."""
    return list(dict.fromkeys(NOTES))
