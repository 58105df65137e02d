"""``opus status`` and ``opus runs``: read a run directory without touching it."""

from __future__ import annotations

import argparse
import fcntl
import os
import time
from pathlib import Path
from typing import Any

from opus.atomic import read_json
from opus.errors import EXIT_OK, InputError
from opus.pipeline.events import EventLog
from opus.pipeline.progress import PROGRESS_FILE, RunEta, describe_running, format_duration
from opus.pipeline.run_files import read_run_info


def add_parsers(sub: Any) -> None:
    status = sub.add_parser("status", help="where a run stands, with the running stage's progress")
    status.add_argument("run_dir", type=Path, nargs="?", help="default: the latest run in --runs-dir")
    status.add_argument("--runs-dir", type=Path, default=Path("runs"))
    runs = sub.add_parser("runs", help="list runs")
    runs.add_argument("--runs-dir", type=Path, default=Path("runs"))


def is_running(run_dir: Path) -> bool:
    """True while some process holds the run's lock."""
    path = run_dir / ".lock"
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def run_state(run_dir: Path) -> dict[str, Any]:
    """Status and per-stage outcome, from summary.json or, mid-run, from the event log."""
    summary_path = run_dir / "summary.json"
    events = EventLog(run_dir).read()
    if not (run_dir / "run.json").is_file():
        raise InputError("not a run directory (no run.json)", file=str(run_dir))
    read_run_info(run_dir / "run.json", "cannot tell the run's status", fields=False)  # a torn one is no finished run
    stages: dict[str, str] = {}
    for event in events:
        name = event["event"]
        if name.startswith("stage_") and "stage" in event:
            stages[event["stage"]] = name.removeprefix("stage_")
        elif name == "rollback":
            stages[event["stage"]] = f"rolled back ({event['reason']})"
    summary = read_json(summary_path) if summary_path.is_file() else None
    status = "running" if is_running(run_dir) else (summary or {}).get("status", "stopped (resumable)")
    last = events[-1]["time"] if events else None
    return {"status": status, "stages": stages, "summary": summary, "last_event": last}


def _created(run_dir: Path) -> float:
    """When the run began: run.json's ``created``, else the file's modification time."""
    try:
        created = read_json(run_dir / "run.json").get("created")
    except (OSError, ValueError, AttributeError):
        created = None
    return created if isinstance(created, (int, float)) else (run_dir / "run.json").stat().st_mtime


def latest_run(runs_dir: Path) -> Path:
    runs = [p for p in runs_dir.glob("*") if (p / "run.json").is_file()]
    if not runs:
        raise InputError("no runs here; name a run directory", file=str(runs_dir))
    return max(runs, key=_created)


def running_progress(run_dir: Path) -> list[str]:
    """The running stages' lines from progress.json (the display rewrites it every few seconds)."""
    try:
        progress = read_json(run_dir / PROGRESS_FILE)
    except (OSError, ValueError):
        return []  # not written yet (an older opus, or the first stage has not started)
    now = time.time()
    lines = [f"  running {describe_running(entry, now)}" for entry in progress.get("running", [])]
    if lines:
        eta = RunEta(progress.get("run_eta_s"), bool(progress.get("run_eta_estimated"))).text()
        lines.append(f"  run ETA {eta}  (as of {format_duration(now - progress.get('updated', now))} ago)")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = latest_run(args.runs_dir)
        print(f"latest run in {args.runs_dir}:")
    state = run_state(run_dir)
    print(f"{run_dir}: {state['status']}")
    if state["last_event"]:
        print(f"  last event {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(state['last_event']))}")
    for stage, outcome in state["stages"].items():
        print(f"  {stage:<20} {outcome}")
    if state["status"] == "running":
        for line in running_progress(run_dir):
            print(line)
    summary = state["summary"]
    if summary and summary.get("ratios"):
        print("  vs baseline: " + "  ".join(f"{k} ×{v:.3f}" for k, v in summary["ratios"].items()))
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    runs = sorted(p for p in args.runs_dir.glob("*") if (p / "run.json").is_file())
    if not runs:
        print(f"no runs in {args.runs_dir}")
    for run_dir in runs:
        try:
            state = run_state(run_dir)
        except InputError:  # one torn run.json must not hide the other runs
            print(f"{run_dir.name:<40} damaged run file")
            continue
        ratios = (state["summary"] or {}).get("ratios", {})
        shown = "  ".join(f"{k.split('_')[0]} ×{v:.2f}" for k, v in ratios.items())
        print(f"{run_dir.name:<40} {state['status']:<20} {shown}")
    return EXIT_OK


COMMANDS = {"status": cmd_status, "runs": cmd_runs}
