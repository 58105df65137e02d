"""The files of a run directory that more than one room reads, and finding a stage's published artifact."""

from __future__ import annotations

from pathlib import Path

from opus.atomic import read_json

ARTIFACTS_DIR = "artifacts"  # artifacts/<stage-id>/<name>: small artifacts of the kept stages
CHECKPOINTS_FILE = "checkpoints.json"
SUMMARY_FILE = "summary.json"


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
