"""Verifying a run (``opus verify RUN_DIR``): every checkpoint's hashes and the lineage between them,
read-only: for each stage what a resume would do (reuse, retry, recompute) and why, and whether the
run's summary.json describes the checkpoints that are there now. opus.cli.run prints it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opus.atomic import read_json


def verify_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(what a resume would do per stage, where summary.json disagrees with the checkpoints)."""
    from opus.pipeline.events import Unobserved
    from opus.pipeline.run_files import SUMMARY_FILE, load_run
    from opus.pipeline.runner import Runner

    runner = Runner(load_run(run_dir), run_dir, Unobserved())
    plan = runner.resume_plan()
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.is_file():
        return plan, ["no summary.json: the run never ended (interrupted or killed); `opus resume` finishes it"]
    recorded = {s["id"]: s.get("key") for s in read_json(summary_path).get("stages", [])}
    stale = [f"summary.json describes stage '{p['stage']}' under another key than its checkpoint"
             for p in plan if p["action"] == "reuse" and recorded.get(p["stage"]) != p.get("key")]
    return plan, stale

