"""Optional ``torch.compile`` on top of fusion, kept only where a decode step gets faster.

Compiling is done in place (``nn.Module.compile``), so parameter names — and therefore the
checkpoint — are unchanged; the recipe step records the settings and replay compiles again on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opus.fusion.measure import decode_step_s


@dataclass
class CompileDecision:
    kept: bool
    eager_ms: float
    compiled_ms: float | None
    reason: str
    settings: dict[str, Any]


def compile_model(model: nn.Module, settings: dict[str, Any]) -> nn.Module:
    """``settings``: ``{"backend": "inductor", "mode": None, "dynamic": None}``."""
    model.compile(backend=settings.get("backend", "inductor"), mode=settings.get("mode"),
                  dynamic=settings.get("dynamic"))
    return model


def uncompile(model: nn.Module) -> None:
    model._compiled_call_impl = None  # what nn.Module.compile set; eager again


def decide_compile(model: nn.Module, input_ids: torch.Tensor, settings: dict[str, Any],
                   steps: int = 8) -> CompileDecision:
    """Time a decode step eager, then compiled (after warm-up); keep the compile only if faster."""
    eager = decode_step_s(model, input_ids, steps) * 1e3
    try:
        compile_model(model, settings)
        decode_step_s(model, input_ids, 2)  # compiles prefill and decode shapes
        compiled = decode_step_s(model, input_ids, steps) * 1e3
    except Exception as exc:  # noqa: BLE001 - a backend that cannot compile this model is a "no"
        uncompile(model)
        reason = f"compile failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        return CompileDecision(False, eager, None, reason, settings)
    if compiled < eager:
        return CompileDecision(True, eager, compiled, f"decode step {eager:.2f} -> {compiled:.2f} ms", settings)
    uncompile(model)
    return CompileDecision(False, eager, compiled, f"not faster: decode step {eager:.2f} eager vs "
                                                  f"{compiled:.2f} ms compiled", settings)
