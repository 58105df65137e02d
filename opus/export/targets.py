"""What one export target (native, hf, gguf, onnx) reports: exported or not, why not, where, what it measured.

Every target of the export stage returns a ``TargetOutcome``. The stage turns each into a metric
``<name>_exported`` (1 or 0, so a gate can require a target), the console line, the report, and the
export record (``opus-export.json``). A target never raises for a model it cannot represent: it
returns ``exported=False`` with the reason. Layers a target had to store differently from the plan
(a format with no representation there) are named in ``layers_not_as_planned`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TARGETS = ("native", "hf", "gguf", "onnx")
EXPORTS_FILE = "exports.json"  # the export stage's published artifact: every target's record (the report reads it)


@dataclass
class TargetOutcome:
    name: str  # one of TARGETS
    exported: bool
    reason: str | None = None  # why not exported (one line), None when exported
    path: str | None = None  # file or directory, relative to the export directory
    metrics: dict[str, float] = field(default_factory=dict)  # names prefixed by the target, e.g. gguf_file_mb
    info: dict[str, Any] = field(default_factory=dict)
    layers_not_as_planned: dict[str, str] = field(default_factory=dict)  # layer -> how it was stored and why

    def __post_init__(self) -> None:
        if self.name not in TARGETS:
            raise ValueError(f"unknown export target '{self.name}' (known: {', '.join(TARGETS)})")
        if not self.exported and not self.reason:
            raise ValueError(f"export target '{self.name}' not exported without a reason")

    def all_metrics(self) -> dict[str, float]:
        return {f"{self.name}_exported": int(self.exported), **self.metrics}

    def record(self) -> dict[str, Any]:
        """The JSON the export record and the stage info keep for this target."""
        return {"exported": self.exported, "reason": self.reason, "path": self.path, "info": self.info,
                "layers_not_as_planned": self.layers_not_as_planned}

    def console(self) -> str:
        if self.exported:
            return f"{self.name}: {self.path}"
        return f"{self.name}: not exported ({self.reason})"
