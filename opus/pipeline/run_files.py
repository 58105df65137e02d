"""The files of a run directory that more than one module reads: their names, reading run.json and the
pipeline a run was run with, finding a stage's published artifact, the run's final checkpoint and its exports.

Paths written into a run's files are relative (``opus.atomic.relative_path``): to the run directory in run.json
(``pipeline``, ``base_dir``) and summary.json (each stage's ``dir``), so a run directory moved, copied or
checked out from git elsewhere reads the same. Absolute paths written by earlier versions still read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opus.atomic import read_json
from opus.errors import InputError
from opus.pipeline.contracts import read_result
from opus.pipeline.spec import LoadedPipeline, load_pipeline

ARTIFACTS_DIR = "artifacts"  # artifacts/<stage-id>/<name>: small artifacts of the kept stages
CHECKPOINTS_FILE = "checkpoints.json"
SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"  # the run's identity, base_dir and starts
PIPELINE_FILE = "pipeline.yaml"  # the pipeline as run (with --set overrides applied)
EXPORT_RECORD = "opus-export.json"  # what marks an export directory (opus.export.native.EXPORT_FILE)
KEPT = ("done", "cached")  # stage statuses whose checkpoint holds the stage's own output


def resolve_from(path: Path | str, start: Path | str) -> Path:
    """A path as a run file stores it: relative to ``start``, or absolute (written by an older version)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else Path(start) / path


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


def read_run_info(path: Path, cannot: str = "cannot resume", fields: bool = True) -> dict[str, Any]:
    """run.json, or a one-line InputError naming it when it is damaged (a torn write, an edit); ``cannot``
    says what the caller cannot do then. ``fields``: its base_dir and starts must be there too (resume)."""
    try:
        info = read_json(path)
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or not UTF-8
        raise InputError(f"damaged run file, {cannot}: {exc}", file=str(path)) from None
    if not isinstance(info, dict):
        raise InputError(f"damaged run file, {cannot}: a JSON object expected, got {type(info).__name__}",
                         file=str(path))
    base_dir = info.get("base_dir")
    if not fields:
        return info
    if not isinstance(base_dir, str) or not base_dir or not isinstance(info.get("starts"), list):
        missing = "base_dir" if not isinstance(base_dir, str) or not base_dir else "starts"
        raise InputError(f"damaged run file, {cannot}: no valid '{missing}'", file=str(path))
    return info


def run_base_dir(run_dir: Path, info: dict[str, Any]) -> Path:
    """The directory the run's pipeline paths are relative to (run.json ``base_dir``, relative to the run)."""
    return resolve_from(info["base_dir"], run_dir).resolve()


def load_run(run_dir: Path) -> LoadedPipeline:
    """The pipeline a run directory was run with, as it was run (for resume and verify)."""
    run_dir = Path(run_dir)
    run_file = run_dir / RUN_FILE
    if not run_file.is_file():
        raise InputError("not a run directory (no run.json)", file=str(run_dir))
    info = read_run_info(run_file)
    return load_pipeline(run_dir / PIPELINE_FILE, base_dir=run_base_dir(run_dir, info))


def kept_stages(run_dir: Path) -> list[tuple[str, Path, dict[str, Any]]]:
    """(stage id, checkpoint dir, summary row) of every kept stage (done or cached), in execution order.

    From summary.json; a ``dir`` that is not there (written absolute on another machine, or the run
    moved) is looked up by name under the run's ``stages/``.
    """
    run_dir = Path(run_dir)
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.is_file():
        return []
    kept = []
    for row in read_json(summary_path).get("stages", []):
        if row.get("status") not in KEPT or not row.get("dir"):
            continue
        path = resolve_from(row["dir"], run_dir)
        path = path if path.is_dir() else run_dir / "stages" / Path(row["dir"]).name
        if path.is_dir():
            kept.append((row["id"], path, row))
    return kept


def final_checkpoint(run_dir: Path) -> tuple[Path | None, str | None]:
    """The last kept stage's checkpoint: from summary.json, else (a stopped run) from the stage dirs."""
    run_dir = Path(run_dir)
    if (run_dir / SUMMARY_FILE).is_file():
        kept = kept_stages(run_dir)
        return (kept[-1][1], kept[-1][0]) if kept else (None, None)
    committed = []
    for path in sorted((run_dir / "stages").glob("[0-9][0-9]-*")):
        try:
            result = read_result(path)
        except (OSError, ValueError):  # ValueError: not JSON, or not a result record
            continue
        if (path / "manifest.json").is_file() and result.status == "done":
            committed.append(path)
    return (committed[-1], committed[-1].name[3:]) if committed else (None, None)


def export_dirs(run_dir: Path) -> list[Path]:
    """The export directories of the run's kept export stages, in execution order.

    Each is a directory holding ``opus-export.json``: inside the stage's checkpoint (its
    ``artifacts/``), or where the stage's ``dir`` setting put it (the result's ``info.export_dir``:
    relative to the run directory, or absolute).
    """
    run_dir = Path(run_dir)
    found: list[Path] = []
    for _, path, row in kept_stages(run_dir):
        if row.get("role") != "export":
            continue
        own = sorted((p.parent for p in (path / ARTIFACTS_DIR).rglob(EXPORT_RECORD)),
                     key=lambda p: (len(p.parts), str(p)))
        chosen = own[:1]
        try:
            elsewhere = read_result(path).info.get("export_dir")
        except (OSError, ValueError):
            elsewhere = None
        if isinstance(elsewhere, str) and not chosen:
            target = resolve_from(elsewhere, run_dir)
            chosen = [target] if (target / EXPORT_RECORD).is_file() else []
        found.extend(p for p in chosen if p not in found)
    return found
