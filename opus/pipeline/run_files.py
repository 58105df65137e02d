"""The files of a run directory that more than one module reads: their names, reading run.json and the
pipeline a run was run with, and finding a stage's published artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opus.atomic import read_json
from opus.errors import InputError
from opus.pipeline.spec import LoadedPipeline, load_pipeline

ARTIFACTS_DIR = "artifacts"  # artifacts/<stage-id>/<name>: small artifacts of the kept stages
CHECKPOINTS_FILE = "checkpoints.json"
SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"  # the run's identity, base_dir and starts
PIPELINE_FILE = "pipeline.yaml"  # the pipeline as run (with --set overrides applied)


def find_artifact(run_dir: Path, name: str) -> tuple[str, Path] | None:
    """The latest kept stage's published artifact called ``name``: (stage id, path), or None."""
    run_dir = Path(run_dir)
    summary_path = run_dir / SUMMARY_FILE
    order = [r["id"] for r in read_json(summary_path).get("stages", [])] if summary_path.is_file() else []
    root = run_dir / ARTIFACTS_DIR
    found = [(order.index(p.parent.name) if p.parent.name in order else -1, p.parent.name, p)
             for p in root.glob(f"*/{name}")] if root.is_dir() else []
    if not found:
        return None
    _, stage_id, path = max(found)
    return stage_id, path


def source_bytes(source: dict[str, Any], base_dir: Path) -> int:
    """Size of a model source on disk (0 for a factory): what a full checkpoint of it may take."""
    path = source.get("hf") or source.get("gguf")
    if not path:
        return 0
    root = base_dir / path
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    return sum(p.stat().st_size for p in files)


def read_run_info(path: Path) -> dict[str, Any]:
    """run.json, or a one-line InputError naming it when it is damaged (a torn write, an edit)."""
    try:
        info = read_json(path)
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or not UTF-8
        raise InputError(f"damaged run file, cannot resume: {exc}", file=str(path)) from None
    if not isinstance(info, dict):
        raise InputError(f"damaged run file, cannot resume: a JSON object expected, got {type(info).__name__}",
                         file=str(path))
    base_dir = info.get("base_dir")
    if not isinstance(base_dir, str) or not base_dir or not isinstance(info.get("starts"), list):
        missing = "base_dir" if not isinstance(base_dir, str) or not base_dir else "starts"
        raise InputError(f"damaged run file, cannot resume: no valid '{missing}'", file=str(path))
    return info


def load_run(run_dir: Path) -> LoadedPipeline:
    """The pipeline a run directory was run with, as it was run (for resume and verify)."""
    run_file = run_dir / RUN_FILE
    if not run_file.is_file():
        raise InputError("not a run directory (no run.json)", file=str(run_dir))
    info = read_run_info(run_file)
    return load_pipeline(run_dir / PIPELINE_FILE, base_dir=Path(info["base_dir"]))
