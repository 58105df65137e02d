"""The KV-cache choice as it passes between stages: typed, versioned documents written and read here.

``KVCacheStep``: the recipe step the kv_config stage appends, ``{"kind": "kv_cache", "cache": {...},
"sizing": {...}}``. Baseline, eval, the engine, ``opus serve`` and the bench read the last such step
(``cache_config_from_recipe``, ``sizing_from_recipe``); the cache config itself is each kind's own
options (opus.kv.cache checks them when it builds one). ``KVConfigReport``: kv_config.json, the stage's
report (the candidates measured, the winners per batch size, the choice, the sizing), which
``run.decisions_from`` replays (``read_kv_report``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from opus.errors import InputError, first_complaint
from opus.kv.cache import describe_cache, unavailable_for
from opus.recipe import RecipeStep, register_transform, steps_of

RECIPE_KIND = "kv_cache"
KV_CONFIG_FILE = "kv_config.json"
REPORT_VERSION = 1


class KVSizing(BaseModel):
    """What the budget held when kv_config measured: ``opus serve`` sizes its pool from it by default."""

    model_config = ConfigDict(extra="forbid")

    kv_bytes_per_token: int
    memory_budget_mb: float
    context: int  # positions a sequence of the workload takes
    max_context: int
    max_batch: int  # sequences of ``context`` positions the chosen cache fits in the budget
    batch_size: int  # the batch size the best throughput was measured at


class KVCacheStep(RecipeStep):
    """The chosen cache (one kind's config, or ``by_batch`` rules of them) and the sizing it was chosen under
    (absent in steps written before sizing was recorded)."""

    kind: Literal["kv_cache"] = RECIPE_KIND
    cache: dict[str, Any] = Field(default_factory=dict)
    sizing: KVSizing | None = None


def kv_cache_step(config: dict[str, Any], sizing: KVSizing | None = None) -> KVCacheStep:
    """The recipe step a kv_config stage appends."""
    return KVCacheStep(cache=dict(config), sizing=sizing)


def cache_config_from_recipe(recipe: list[Any] | None) -> dict[str, Any] | None:
    """The cache config of the last ``kv_cache`` step, or None (the growing default)."""
    steps = steps_of(recipe, KVCacheStep)
    return dict(steps[-1].cache) if steps else None


def sizing_from_recipe(recipe: list[Any] | None) -> KVSizing | None:
    """The sizing the last ``kv_cache`` step was chosen under, or None."""
    steps = steps_of(recipe, KVCacheStep)
    return steps[-1].sizing if steps else None


@register_transform(RECIPE_KIND, KVCacheStep, provider_module="opus.kv.choice")
def _apply_kv_cache_step(model: Any, step: KVCacheStep) -> Any:
    """A KV cache choice changes no weights: rebuilding a state checks the kind can be built, and says so
    where the cache cannot run here as the run measured it (another CPU or device: it runs a fallback)."""
    if why := unavailable_for(model, step.cache):
        warnings.warn(f"the run's KV cache ({describe_cache(step.cache)}) does not run here as it was measured: "
                      f"{why}", RuntimeWarning, stacklevel=2)
    return model


class KVWorkload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_len: int
    output_len: int
    batch_sizes: list[int]
    rounds: int


class KVConfigReport(BaseModel):
    """kv_config.json. ``candidates`` and ``unavailable`` are rows as measured (a cache config, the batch
    size, the figures or why it was skipped); ``winners`` is the cache chosen per batch size (str keys)."""

    model_config = ConfigDict(extra="forbid")

    version: int = REPORT_VERSION
    chosen: dict[str, Any]
    sizing: KVSizing
    candidates: list[dict[str, Any]] = Field(default_factory=list)
    unavailable: list[dict[str, Any]] = Field(default_factory=list)
    winners: dict[str, dict[str, Any]] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    kv_fidelity: dict[str, Any] = Field(default_factory=dict)
    workload: KVWorkload | None = None


def read_kv_report(path: Path) -> KVConfigReport:
    """An earlier run's kv_config.json; an InputError naming the file and the field otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise InputError(f"cannot read the KV cache report: {error}", file=str(path)) from None
    try:
        report = KVConfigReport.model_validate(data)
    except ValidationError as error:
        key, message, _ = first_complaint(error)
        raise InputError(f"{key or 'the report'}: {message}", file=str(path)) from None
    if report.version != REPORT_VERSION:
        raise InputError(f"version {report.version} of the KV cache report is not one this Opus reads "
                         f"({REPORT_VERSION})", file=str(path))
    return report
