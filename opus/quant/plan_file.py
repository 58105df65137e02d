"""The plan stage's document (``plan.yaml``): each layer group's format, its scores and timings, and why.

One typed, versioned document, written and read here only: by the plan stage (made, replayed with
``run.decisions_from`` or taken from a hand-edited ``plan_file``), the quantize stage, the report and
the benches. A hand-edited plan with a typo or an unknown format is one line naming the key.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from opus.errors import InputError, first_complaint
from opus.quant.formats import FORMATS, known

PLAN_FILE = "plan.yaml"
PLAN_VERSION = 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanGroup(_Part):
    """One group of linears that take one format together (a layer's q/k/v, a MoE layer's experts)."""

    name: str
    role: str | None = None
    format: str
    modules: list[str]
    score: dict[str, float] = Field(default_factory=dict)  # predicted Δ log-perplexity per format
    kl: dict[str, float] = Field(default_factory=dict)
    scored_by: str | dict[str, str] | None = None  # how the scores were obtained (per format where they differ)
    scored_on: str | dict[str, str] | None = None  # where: this process or a cluster worker
    time_ms: dict[str, float] = Field(default_factory=dict)  # the kernel timing's median per format
    margin: float | None = None  # the timing's noise margin
    reason: str = ""
    notes: list[str] = Field(default_factory=list)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value not in FORMATS:
            raise ValueError(f"unknown format '{value}' (known: {', '.join(known())})")
        return value


class Predicted(_Part):
    ppl_increase: float | None = None
    linear_ms_float: float | None = None
    linear_ms_planned: float | None = None
    linear_speedup: float | None = None


class PlanDocument(_Part):
    version: Literal[1] = PLAN_VERSION
    budget: dict[str, Any] = Field(default_factory=dict)  # kind, value, safety
    predicted: Predicted = Field(default_factory=Predicted)
    groups: list[PlanGroup]
    measured: dict[str, Any] | None = None  # the end-to-end check (opus.quant.validate)
    notes: list[str] = Field(default_factory=list)
    group_size: int = 128
    sensitivity: dict[str, Any] | None = None  # how the sweep scored, how many units, where, how long

    def assignment(self) -> dict[str, str]:
        """Module name -> format."""
        return {module: group.format for group in self.groups for module in group.modules}

    def format_counts(self) -> dict[str, int]:
        return dict(Counter(group.format for group in self.groups))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False, width=120)


def plan_from_data(data: Any, file: str | None = None) -> PlanDocument:
    """A plan from parsed YAML; anything that is not one is an InputError naming ``file`` and the key."""
    if not isinstance(data, dict):
        raise InputError(f"a plan is a mapping with 'groups', not {type(data).__name__}", file=file)
    try:
        return PlanDocument.model_validate(data)
    except ValidationError as exc:
        key, message, unknown = first_complaint(exc)
        message = "not a field of a plan" if unknown else message.removeprefix("Value error, ")
        raise InputError(message, file=file, key=key) from None


def read_plan(path: Path) -> PlanDocument:
    if not path.is_file():
        raise InputError("not a regular file" if path.exists() else "plan file not found", file=str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise InputError(f"not a YAML plan: {str(exc).splitlines()[0]}", file=str(path)) from None
    return plan_from_data(data, str(path))
