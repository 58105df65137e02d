"""Apply a precision plan to a model with real kernels, and rebuild that structure from a recipe."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opus.quant.calibrate import ActivationStats
from opus.quant.formats import FORMATS, check_format
from opus.quant.smooth import apply_smoothing, smooth_groups
from opus.recipe import register_transform

RECIPE_KIND = "quantize"


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
                   *, group_size: int = 128, alpha: float | None = None) -> dict[str, Any]:
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
    layers: dict[str, dict[str, Any]] = {}
    for name, fmt in assignment.items():
        linear = _linear(model, name)
        if FORMATS[fmt].is_noop:
            continue
        with torch.no_grad():
            _replace(model, name, FORMATS[fmt].build(linear, group_size))
        layers[name] = {"format": fmt, **FORMATS[fmt].recipe_options(group_size)}
    return {"kind": RECIPE_KIND, "layers": layers, "smoothing_alpha": smoothed}


@register_transform(RECIPE_KIND)
def rebuild(model: nn.Module, step: dict[str, Any]) -> nn.Module:
    """Recreate the quantized modules (empty) so that the checkpoint's packed tensors load into them."""
    for name, spec in step["layers"].items():
        fmt = FORMATS[spec["format"]]
        linear = _linear(model, name)
        _replace(model, name, fmt.empty(linear, spec.get("group_size", 128)))
    return model
