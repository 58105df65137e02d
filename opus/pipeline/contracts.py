"""What the runner, the worker and the gates hand each other, typed, and the one place each is read or written.

    runner --Job (job.json)--> worker --progress lines--> supervise --WorkerOutcome--> runner
    worker --ResultRecord (result.json) + error.json (WorkerError)--> runner --GateVerdict--> Failure

The JSON on disk is what it was before these types (old checkpoints read the same); a field added
later gets a default, so a file written by an older Opus still validates. Dumps use pydantic's python
mode, never its json mode: that would turn a NaN metric into null, and a NaN must fail its gate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from opus.atomic import read_json, write_json

JOB_FILE = "job.json"
RESULT_FILE = "result.json"
ERROR_FILE = "error.json"
ARTIFACTS_SUBDIR = "artifacts"  # a checkpoint's own artifacts: <checkpoint>/artifacts/<name>


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpstreamView(_Contract):
    """A finished stage as the stages after it see it (directly or transitively)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    uses: str
    key: str
    status: str
    metrics: dict[str, Any]
    dir: Path
    baseline: bool = False

    def artifact(self, name: str) -> Path:
        return self.dir / ARTIFACTS_SUBDIR / name


class Job(_Contract):
    """One attempt of one stage, as the runner asks the worker to run it."""

    run_dir: Path
    stage_id: str
    uses: str
    key: str
    key_parts: dict[str, str] | None = None
    config: dict[str, Any]
    attempt: int = 0
    remedy: dict[str, Any] | None = None
    incoming: Path | None  # the checkpoint whose model state the stage starts from; None: the base model
    upstream: list[UpstreamView] = []
    out_dir: Path
    pipeline: Path
    base_dir: Path

    def write(self, path: Path) -> None:
        write_json(path, self.model_dump())  # paths become strings in write_json; NaN stays NaN

    @classmethod
    def read(cls, path: Path) -> Job:
        return cls.model_validate(read_json(path))


class ResultRecord(BaseModel):
    """``result.json`` of a committed checkpoint: what the stage reported and how it was run."""

    model_config = ConfigDict(extra="allow")  # readers of newer files keep what they do not know

    status: str = "done"
    metrics: dict[str, Any] = {}
    baseline: bool = False
    info: dict[str, Any] = {}
    attempt: int = 0
    config: dict[str, Any] = {}
    remedy: dict[str, Any] | None = None
    duration_s: float | None = None
    warnings: list[str] = []  # StageResult.warnings
    failure: Failure | None = None  # a rolled-back stage's pass-through checkpoint: why

    def as_json(self) -> dict[str, Any]:
        out = self.model_dump()  # python mode: a NaN metric stays NaN (json mode would make it null)
        if out["failure"] is None:  # only pass-through checkpoints have one
            del out["failure"]
        else:
            out["failure"] = self.failure.as_json()
        return out


def read_result(checkpoint: Path) -> ResultRecord:
    return ResultRecord.model_validate(read_json(Path(checkpoint) / RESULT_FILE))


class WorkerError(_Contract):
    """``error.json``: why a worker failed. ``disk`` can pass once space is freed; ``input`` repeats on
    every attempt (bad input, a missing file, an unsupported operation); ``crash`` is anything else."""

    kind: Literal["disk", "input", "crash"]
    message: str

    def write(self, out_dir: Path) -> None:
        write_json(Path(out_dir) / ERROR_FILE, self.model_dump())

    @classmethod
    def read(cls, out_dir: Path) -> WorkerError | None:
        path = Path(out_dir) / ERROR_FILE
        try:
            return cls.model_validate(read_json(path)) if path.is_file() else None
        except (ValueError, OSError):  # a half-written report (the worker was killed writing it)
            return None


class GateCheck(BaseModel):
    """One bound of a gate checked against what a stage measured."""

    model_config = ConfigDict(extra="forbid")

    metric: str
    bound: str  # min | max | min_ratio | max_ratio | max_increase | max_decrease | max_drop | finite
    threshold: float | None
    measured: Any = None
    baseline: float | None = None  # relative bounds only
    passed: bool
    compared: float | None = None  # the quantity compared with the threshold (value, ratio or change)
    interval: tuple[float, float] | None = None  # a side-by-side ratio's or a drop's [low, high]
    inconclusive: bool = False  # passed only as the interval cannot tell (max_drop): the summary warns
    reason: str | None = None


class GateVerdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    passed: bool
    checks: list[GateCheck]

    @property
    def verified(self) -> bool:
        """True when the verdict checked something and everything it checked passed."""
        return bool(self.checks) and self.passed

    def first_failure(self) -> GateCheck | None:
        return next((c for c in self.checks if not c.passed), None)

    def as_json(self) -> dict[str, Any]:
        return self.model_dump()


class Failure(BaseModel):
    """Why an attempt did not commit: a failed gate check, or the worker's outcome."""

    # Rolled-back checkpoints of older runs stored the whole failed check (passed, compared, ...).
    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: str  # gate | crash | input | disk | stalled | timeout
    reason: str
    metric: str | None = None  # gate failures: the check that failed
    bound: str | None = None
    threshold: float | None = None
    measured: Any = None
    baseline: float | None = None

    @classmethod
    def of_gate(cls, check: GateCheck) -> Failure:
        return cls(kind="gate", reason=check.reason or f"{check.metric} {check.bound}", metric=check.metric,
                   bound=check.bound, threshold=check.threshold, measured=check.measured,
                   baseline=check.baseline)

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
