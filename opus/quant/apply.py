"""Apply a precision plan to a model with real kernels, and rebuild that structure from a recipe."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from opus.quant.calibrate import ActivationStats
from opus.quant.formats import FORMATS, check_format
from opus.quant.smooth import apply_smoothing, smooth_groups
from opus.recipe import RecipeStep, register_transform

RECIPE_KIND = "quantize"


class QuantizedLayer(BaseModel):
    """How one layer was quantized: its format and what the format records to rebuild it
    (``Format.recipe_options``: ``group_size`` for the grouped ones; a plugin format may record more)."""

    model_config = ConfigDict(extra="allow")

    format: str
    group_size: int | None = None


class QuantizeStep(RecipeStep):
    """The quantize stage's recipe step: every quantized layer, and the SmoothQuant alpha of each layer smoothed."""

    kind: Literal["quantize"] = RECIPE_KIND
    layers: dict[str, QuantizedLayer]
    smoothing_alpha: dict[str, float] = Field(default_factory=dict)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def _linear(model: nn.Module, name: str) -> nn.Linear:
    module = model.get_submodule(name)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"layer '{name}' is a {type(module).__name__}, not an nn.Linear")
    return module


def quantize_model(model: nn.Module, assignment: dict[str, str], stats: ActivationStats | None,
                   *, group_size: int = 128, alpha: float | None = None) -> QuantizeStep:
    """Quantize ``model`` in place; returns the recipe step that rebuilds its structure.

    Layers in a SmoothQuant format (w8a8, fp8) are smoothed first (exact in float), where the model's
    structure allows.
    """
    device = str(next(model.parameters()).device)
    for fmt in set(assignment.values()):
        check_format(fmt, device)
    smoothed: dict[str, float] = {}
    smooth = {n for n, f in assignment.items() if FORMATS[f].smoothquant}
    if smooth and stats is not None:
        groups = [g for g in smooth_groups(model) if smooth.intersection(g.targets)]
        smoothed = apply_smoothing(model, stats, groups, alpha)
    layers: dict[str, QuantizedLayer] = {}
    for name, fmt in assignment.items():
        linear = _linear(model, name)
        if FORMATS[fmt].is_noop:
            continue
        with torch.no_grad():
            _replace(model, name, FORMATS[fmt].build(linear, group_size))
        layers[name] = QuantizedLayer(format=fmt, **FORMATS[fmt].recipe_options(group_size))
    return QuantizeStep(layers=layers, smoothing_alpha=smoothed)


@register_transform(RECIPE_KIND, QuantizeStep)
def rebuild(model: nn.Module, step: QuantizeStep) -> nn.Module:
    """Recreate the quantized modules (empty) so that the checkpoint's packed tensors load into them."""
    for name, layer in step.layers.items():
        fmt = FORMATS[layer.format]
        linear = _linear(model, name)
        _replace(model, name, fmt.empty(linear, layer.group_size if layer.group_size is not None else 128))
    return model
