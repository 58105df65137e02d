"""Structural transforms written as data in a checkpoint's recipe, and how to re-apply them.

A recipe step is ``{"kind": NAME, ...}``. Mechanism modules register an applier for their kind; a
checkpoint is rebuilt by loading the base model, applying the recipe in order, then loading the
tensors that differ from the base.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opus import moved

Applier = Callable[[Any, dict[str, Any]], Any]

_APPLIERS: dict[str, Applier] = {}
# Kinds whose applier lives in a module that registers it on import.
_PROVIDERS: dict[str, str] = {"quantize": "opus.quant.apply", "shared_embedding": "opus.quant.tied",
                               "fuse": "opus.fusion.rewrite", "kv_cache": "opus.kv.cache"}


def register_transform(kind: str, provider_module: str | None = None) -> Callable[[Applier], Applier]:
    def decorator(fn: Applier) -> Applier:
        _APPLIERS[kind] = fn
        return fn

    if provider_module:
        _PROVIDERS[kind] = provider_module
    return decorator


def apply_step(model: Any, step: dict[str, Any]) -> Any:
    """Apply one recipe step; returns the (possibly replaced) model."""
    kind = step.get("kind")
    if kind not in _APPLIERS and kind in _PROVIDERS:
        moved.import_module(_PROVIDERS[kind], f"the provider of the recipe step {kind!r}")
    if kind not in _APPLIERS:
        known = ", ".join(sorted(set(_APPLIERS) | set(_PROVIDERS))) or "none"
        raise ValueError(f"recipe step of unknown kind '{kind}' (known: {known})")
    result = _APPLIERS[kind](model, step)
    return model if result is None else result
