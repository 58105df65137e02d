"""What ``opus bench PIPELINE_OR_RUN`` compares: the pipeline, and the model an Opus run produced.

- A pipeline file: the workload, data and model come from it; the Opus contender is the latest
  finished run of that pipeline under the runs directory (matched by the pipeline file's path, else
  by the pipeline's name), or none — then that row says so.
- A run directory: its own ``pipeline.yaml`` (with the run's base directory, as ``opus resume``
  reads it), and its final model: the checkpoint of the last kept stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opus.atomic import read_json
from opus.errors import InputError
from opus.pipeline.checkpoint import intact
from opus.pipeline.run_files import final_checkpoint, resolve_from, run_base_dir
from opus.pipeline.spec import LoadedPipeline, load_pipeline

DEFAULT_BUDGET = 0.01


@dataclass
class Target:
    loaded: LoadedPipeline
    run_dir: Path | None = None
    checkpoint: Path | None = None  # the run's final model state
    stage: str | None = None  # the stage that committed it
    no_run_reason: str = ""


def _run_info(run_dir: Path) -> dict[str, Any] | None:
    try:
        return read_json(run_dir / "run.json")
    except (OSError, ValueError):
        return None


def latest_finished_run(loaded: LoadedPipeline, runs_dir: Path) -> Path | None:
    """The newest run under ``runs_dir`` of this pipeline file (else of this pipeline name) that finished."""
    candidates: list[tuple[float, bool, Path]] = []
    pipeline = str(loaded.path.resolve())
    for run_dir in runs_dir.glob("*"):
        info = _run_info(run_dir)
        if info is None or info.get("name") != loaded.spec.name:
            continue
        try:
            status = read_json(run_dir / "summary.json").get("status")
        except (OSError, ValueError):
            continue
        if status == "finished":
            started = max(info.get("starts") or [info.get("created", 0.0)])
            same = bool(info.get("pipeline")) and str(resolve_from(info["pipeline"], run_dir).resolve()) == pipeline
            candidates.append((started, same, run_dir))
    same_file = [c for c in candidates if c[1]]
    chosen = max(same_file or candidates, default=None)
    return chosen[2] if chosen else None


def resolve_target(path: Path, runs_dir: Path) -> Target:
    if path.is_dir():
        info = _run_info(path)
        if info is None:
            raise InputError("neither a pipeline file nor a run directory (no run.json)", file=str(path))
        loaded = load_pipeline(path / "pipeline.yaml", base_dir=run_base_dir(path, info))
        checkpoint, stage = final_checkpoint(path)
        reason = "" if checkpoint else f"run {path} has no committed stage yet"
        return Target(loaded, path, checkpoint and intact(checkpoint), stage, reason)
    if not path.is_file():
        raise InputError("no such pipeline file or run directory", file=str(path))
    loaded = load_pipeline(path)
    run_dir = latest_finished_run(loaded, runs_dir)
    if run_dir is None:
        return Target(loaded, no_run_reason=f"no finished run of pipeline '{loaded.spec.name}' under {runs_dir}/ "
                                            f"(run `opus run {path}` first, or give a run directory)")
    checkpoint, stage = final_checkpoint(run_dir)
    reason = "" if checkpoint else f"run {run_dir} has no kept stage"
    return Target(loaded, run_dir, checkpoint and intact(checkpoint), stage, reason)


def pipeline_budget(loaded: LoadedPipeline) -> tuple[float, str]:
    """The accuracy budget (max relative perplexity increase) and where it comes from.

    The last ``eval`` stage's perplexity gate (``max_increase``), as the pipeline would judge its own
    result; else the default +1 %.
    """
    from opus.pipeline.gates import metric_key

    for stage in reversed(loaded.spec.stages):
        if stage.uses != "eval":
            continue
        for name, threshold in stage.gate.items():
            if metric_key(name) == "perplexity" and threshold.max_increase is not None:
                return threshold.max_increase, f"stage '{stage.id}' gate perplexity.max_increase"
    return DEFAULT_BUDGET, "default"
