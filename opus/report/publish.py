"""A run's small, trackable files: copied out of the (git-ignored) checkpoints to the run's top level.

After a run, ``publish(run_dir)`` writes

    artifacts/<stage-id>/<name>   small text artifacts of the kept stages (plan.yaml, profile.json ...)
    checkpoints.json              every checkpoint file by sha256 (tensors are referenced, never copied)

so that ``tracked_files`` — the summary, the pipeline as run, events, run.json, the report and these —
describe the run completely without its tensors, in git or anywhere else.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from opus.atomic import fsync_dir, read_json, write_json
from opus.pipeline.run_files import ARTIFACTS_DIR, CHECKPOINTS_FILE

REPORT_FILES = ("report.md", "report.html")
REPORT_ASSETS = "report"  # PNGs beside report.md
TOP_FILES = ("run.json", "pipeline.yaml", "events.jsonl", "summary.json", CHECKPOINTS_FILE, *REPORT_FILES)
TEXT_SUFFIXES = {".json", ".yaml", ".yml", ".md", ".txt", ".csv", ".html"}
MAX_ARTIFACT_BYTES = 1 << 20  # bigger artifacts stay in the checkpoint (and out of git)
MAX_TRACKED_BYTES = 16 << 20  # a sanity bound: git is not the place for a huge event log


def ratio_line(ratios: dict[str, Any]) -> str:
    """``P ×1.820  D ×0.910  ppl ×1.004  mem ×0.500`` from summary ratios (only those present)."""
    labels = (("throughput_tok_s", "P"), ("ttft_ms", "D"), ("perplexity", "ppl"), ("peak_mem_mb", "mem"))
    return "  ".join(f"{label} ×{ratios[key]:.3f}" for key, label in labels
                     if isinstance(ratios.get(key), (int, float)))


def kept_stage_dirs(run_dir: Path, summary: dict[str, Any]) -> list[tuple[str, Path]]:
    """(stage id, checkpoint dir) of every stage with a checkpoint, in execution order."""
    out = []
    for record in summary.get("stages", []):
        path = Path(record["dir"]) if record.get("dir") else None
        if path is not None and not path.is_absolute():
            path = run_dir / path
        if path is None or not path.is_dir():  # the recorded absolute path may be another machine's
            found = sorted((run_dir / "stages").glob(f"[0-9][0-9]-{record['id']}"))
            path = found[-1] if found else None
        if path is not None:
            out.append((record["id"], path))
    return out


def _small_text(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES and path.stat().st_size <= MAX_ARTIFACT_BYTES


def publish(run_dir: Path) -> list[Path]:
    """Copy small stage artifacts and the checkpoint hashes to the run's top level; returns what was written.

    Without checkpoints (a run checked out from git) the published files are left as they are.
    """
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file() or not (run_dir / "stages").is_dir():
        return []
    for prefix in (".tmp", ".old"):  # left by a publish that was killed half-way
        for leftover in run_dir.glob(f"{prefix}-{ARTIFACTS_DIR}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    stages = kept_stage_dirs(run_dir, read_json(summary_path))
    checkpoints: list[dict[str, Any]] = []
    tmp = run_dir / f".tmp-{ARTIFACTS_DIR}-{uuid.uuid4().hex[:6]}"
    written: list[Path] = []
    try:
        for stage_id, path in stages:
            manifest = path / "manifest.json"
            if manifest.is_file():
                data = read_json(manifest)
                checkpoints.append({"stage": stage_id, "dir": f"stages/{path.name}", "key": data.get("key"),
                                    "files": data.get("files", {})})
            source = path / "artifacts"
            for file in sorted(source.rglob("*")) if source.is_dir() else []:
                if file.is_file() and _small_text(file):
                    target = tmp / stage_id / file.relative_to(source)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, target)
                    written.append(run_dir / ARTIFACTS_DIR / target.relative_to(tmp))
        final = run_dir / ARTIFACTS_DIR
        old = run_dir / f".old-{ARTIFACTS_DIR}-{uuid.uuid4().hex[:6]}"
        if final.exists():
            os.replace(final, old)
        if tmp.exists():
            os.replace(tmp, final)
        fsync_dir(run_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(run_dir / CHECKPOINTS_FILE, {"checkpoints": checkpoints})
    return [*written, run_dir / CHECKPOINTS_FILE]


def tracked_files(run_dir: Path) -> list[Path]:
    """The run's small files that belong in version control (existing ones only, sorted)."""
    run_dir = Path(run_dir)
    files = [run_dir / name for name in TOP_FILES if (run_dir / name).is_file()]
    for folder in (ARTIFACTS_DIR, REPORT_ASSETS):
        root = run_dir / folder
        files += [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    return sorted(p for p in files if p.stat().st_size <= MAX_TRACKED_BYTES)
