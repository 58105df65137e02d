"""The contract between the runner and a stage type.

A stage type's entry function is ``run(ctx: StageContext, cfg: Config) -> StageResult``. It runs in
a worker process; the runner never holds a model, so a crash, OOM or hang in a stage cannot take the
run with it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opus.pipeline.contracts import ARTIFACTS_SUBDIR, UpstreamView
from opus.pipeline.spec import PipelineSpec
from opus.pipeline.units import UnitStore, unit_scope, units_root
from opus.recipe import RecipeStep


@dataclass
class StageResult:
    """What a stage returns.

    ``model`` is the transformed model, or None when the incoming state passes through unchanged.
    ``recipe`` lists the structural transforms (as data) this stage applied on top of the incoming
    recipe, so that resume can rebuild the structure before loading tensors.
    """

    metrics: dict[str, Any] = field(default_factory=dict)
    model: Any = None
    recipe: list[RecipeStep | dict[str, Any]] = field(default_factory=list)  # opus.recipe: typed steps
    baseline: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    # What the stage did not do that a person would assume it did (an export target that failed, ...):
    # shown on the console line, listed in the run's warnings and the report. Never a reason to fail.
    warnings: list[str] = field(default_factory=list)


@dataclass
class StageContext:
    run_dir: Path
    stage_id: str
    uses: str
    spec: PipelineSpec
    base_dir: Path
    upstream: dict[str, UpstreamView]  # finished stages this one depends on (directly or transitively)
    incoming: Path | None  # checkpoint directory whose model state this stage starts from
    out_dir: Path  # the checkpoint being built; artifacts go under out_dir / "artifacts"
    attempt: int = 0
    remedy: dict[str, Any] | None = None
    report: Callable[[dict[str, Any]], None] = field(default=lambda msg: None, repr=False)
    key: str = ""  # the stage key (opus.pipeline.keys): finished units are kept under it
    config: dict[str, Any] = field(default_factory=dict)  # this attempt's configuration, as JSON
    _loaded: Any = field(default=None, repr=False)
    _started: float = field(default_factory=time.monotonic, repr=False)
    _last_progress: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def artifact_dir(self) -> Path:
        path = self.out_dir / ARTIFACTS_SUBDIR
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def workload(self):  # noqa: ANN201 - WorkloadSpec
        return self.spec.workload

    @property
    def baseline(self) -> dict[str, Any] | None:
        """Metrics of the baseline measured earlier in this run, if any."""
        for up in self.upstream.values():
            if up.baseline:
                return up.metrics
        return None

    def progress(self, done: float, total: float | None = None, what: str = "") -> None:
        """Report progress; this is also the heartbeat the watchdog listens to."""
        self._last_progress = {"t": "progress", "done": done, "total": total, "what": what}
        self.report(self._last_progress)

    def compiling(self, active: bool) -> None:
        """torch started (True) or finished (False) compiling: the last progress again, marked so that
        the runner can say so (and hold the stage's ETA as unknown until the compile ends)."""
        self.report({"t": "progress", "done": None, "total": None, "what": "", **self._last_progress,
                     "compiling": active})

    def log(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        self.report({"t": "log", "message": message})

    def event(self, name: str, **fields: Any) -> None:
        """A line in the run's events.jsonl (written by the runner), e.g. a cluster task retried."""
        self.report({"t": "event", "event": name, "fields": fields})

    def load_model(self) -> Any:
        """The incoming model state, materialized: ``Materialized(model, tokenizer, ...)``."""
        if self._loaded is None:
            from opus.pipeline.state import materialize  # torch is imported only by stages that need it

            self._loaded = materialize(self.incoming, self.spec, self.base_dir)
        return self._loaded

    def release_model(self) -> None:
        """Let go of the materialized model (its memory is freed once no one else holds it); a later
        ``load_model`` materializes it again."""
        self._loaded = None

    def units(self, name: str) -> UnitStore:
        """Where this stage keeps finished units of ``name`` (opus.pipeline.units): reused by the next
        attempt of the same key and configuration, dropped once the stage's checkpoint is committed."""
        scope = unit_scope(self.key, self.config)
        return UnitStore(units_root(self.run_dir / "stages", self.stage_id) / scope / name)

    def write_artifact(self, name: str, obj: Any) -> Path:
        from opus.atomic import write_bytes, write_text

        path = self.artifact_dir / name
        if isinstance(obj, bytes):
            write_bytes(path, obj)
        elif isinstance(obj, str):
            write_text(path, obj)
        else:
            write_text(path, json.dumps(obj, indent=2, default=str) + "\n")
        return path
