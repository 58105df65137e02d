"""Structural transforms written as data in a checkpoint's recipe, and how to re-apply them.

A recipe step is a typed document (``RecipeStep``: its ``kind`` and that kind's fields), stored as a JSON
object in the checkpoint's state. Each kind's module defines its step type and registers it with the
applier (``register_transform``); every step read from disk goes through ``read_step`` here, so a
malformed or unknown step is one line naming the field, and checkpoints written before a field existed
still read (each field that came later has a default). A checkpoint is rebuilt by loading the base model,
applying the recipe in order, then loading the tensors that differ from the base.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from opus import moved
from opus.errors import first_complaint


class RecipeStep(BaseModel):
    """One step: its ``kind`` and, in each kind's subclass, that kind's fields."""

    model_config = ConfigDict(extra="forbid")

    kind: str

    def as_json(self) -> dict[str, Any]:
        """The step as the checkpoint's state stores it."""
        return self.model_dump(mode="json", exclude_none=True)


Step = TypeVar("Step", bound=RecipeStep)
Applier = Callable[[Any, Any], Any]  # (model, the kind's RecipeStep) -> model, or None for the same model

_APPLIERS: dict[str, tuple[Applier, type[RecipeStep]]] = {}
# Kinds whose applier lives in a module that registers it on import.
_PROVIDERS: dict[str, str] = {"quantize": "opus.quant.apply", "shared_embedding": "opus.quant.tied",
                               "fuse": "opus.fusion.rewrite", "kv_cache": "opus.kv.choice"}


def register_transform(kind: str, step_type: type[RecipeStep],
                       provider_module: str | None = None) -> Callable[[Applier], Applier]:
    def decorator(fn: Applier) -> Applier:
        _APPLIERS[kind] = (fn, step_type)
        return fn

    if provider_module:
        _PROVIDERS[kind] = provider_module
    return decorator


def _registered(kind: Any) -> tuple[Applier, type[RecipeStep]]:
    if kind not in _APPLIERS and kind in _PROVIDERS:
        moved.import_module(_PROVIDERS[kind], f"the provider of the recipe step {kind!r}")
    if kind not in _APPLIERS:
        known = ", ".join(sorted(set(_APPLIERS) | set(_PROVIDERS))) or "none"
        raise ValueError(f"recipe step of unknown kind '{kind}' (known: {known})")
    return _APPLIERS[kind]


def read_step(data: dict[str, Any] | RecipeStep) -> RecipeStep:
    """A stored step as its kind's type; a ValueError naming the kind and the field otherwise."""
    if isinstance(data, RecipeStep):
        return data
    kind = data.get("kind") if isinstance(data, dict) else None
    step_type = _registered(kind)[1]
    try:
        return step_type.model_validate(data)
    except ValidationError as error:
        key, message, _ = first_complaint(error)
        raise ValueError(f"recipe step {kind!r}: {key or 'the step'}: {message}") from None


def step_kind(step: dict[str, Any] | RecipeStep) -> str | None:
    return step.kind if isinstance(step, RecipeStep) else step.get("kind")


def steps_of(recipe: list[Any] | None, step_type: type[Step]) -> list[Step]:
    """The recipe's steps of ``step_type``'s kind, read as that type, in order."""
    kind = step_type.model_fields["kind"].default
    found = [read_step(s) for s in recipe or [] if step_kind(s) == kind]
    return [s for s in found if isinstance(s, step_type)]


def stored_recipe(recipe: list[Any] | None) -> list[dict[str, Any]]:
    """A recipe as a checkpoint or an export stores it: each step checked against its kind's type."""
    return [read_step(step).as_json() for step in recipe or []]


def apply_step(model: Any, step: dict[str, Any] | RecipeStep) -> Any:
    """Apply one recipe step; returns the (possibly replaced) model."""
    typed = read_step(step)
    result = _registered(typed.kind)[0](model, typed)
    return model if result is None else result
