"""The K3 pipeline on a quiet machine, then again beside CPU-bound processes: do the side-by-side ratios hold?

A ratio between two figures taken minutes apart measures the machine as much as the model: the eval
stage therefore times the unmodified model beside the optimized one in paired rounds (opus.runtime.paired).
This runs the pipeline twice through the CLI, as a person would: once as it is, then with ``--busy N``
processes spinning on the CPU for the whole run, replaying the first run's decisions (its plan, KV
cache and compile choices: ``--decisions-from``), so that both runs time the same model. It prints, for
each run, the eval's paired ratios with their intervals, and the ratio of the stages' own figures (the
baseline stage's against the eval's, taken minutes apart: what the paired ratio replaced), and says
whether the paired ratios agree within their intervals. A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/busy_neighbour.py            # pipelines/k3.yaml, one spinner
    HF_HUB_OFFLINE=1 .venv/bin/python bench/busy_neighbour.py --busy 2 --runs-dir /tmp/busy
    HF_HUB_OFFLINE=1 .venv/bin/python bench/busy_neighbour.py --set workload.batch_size=8 --set workload.output_len=64

A run that does not finish is one line and exit 1; a wrong path is one line and exit 2. Ctrl-C stops the
spinners with the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opus.runtime.machine import describe  # noqa: E402

KEYS = {"throughput_tok_s": "P", "ttft_ms": "D"}
# A core's worth of work touching little memory. Ctrl-C reaches it too (the same process group, so a closed
# terminal ends it as well); it ignores that and is killed by this script instead, without a traceback.
SPIN = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.nice(int(sys.argv[1]))\n"
        "while True: pass")


def run_pipeline(pipeline: Path, run_dir: Path, decisions_from: Path | None, overrides: list[str]) -> dict[str, Any]:
    """``opus run`` in a child process (its console lines go to this one's stderr); the run's summary."""
    command = [sys.executable, "-m", "opus.cli.main", "run", str(pipeline), "--run-dir", str(run_dir)]
    command += [arg for override in overrides for arg in ("--set", override)]
    if decisions_from is not None:
        command += ["--decisions-from", str(decisions_from)]
    started = time.monotonic()
    code = subprocess.call(command, stdout=sys.stderr, cwd=ROOT)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if code != 0 or summary.get("status") != "finished":
        print(f"busy_neighbour: {run_dir}: the run ended {summary.get('status', 'without a summary')} (exit {code})",
              file=sys.stderr)
        raise SystemExit(1)
    summary["seconds"] = time.monotonic() - started
    return summary


def finished_summary(run_dir: Path) -> dict[str, Any]:
    """A given quiet run's summary; one that is missing or did not finish is bad input (exit 2)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    if summary.get("status") != "finished":
        print(f"busy_neighbour: --quiet-run {run_dir}: not a finished run", file=sys.stderr)
        raise SystemExit(2)
    return summary


def eval_machine(run_dir: Path, stage: str) -> dict[str, Any]:
    """The machine record of the eval's paired rounds (load before and after them)."""
    result = json.loads((run_dir / "stages" / stage / "result.json").read_text())
    return result.get("info", {}).get("side_by_side_machine") or result.get("info", {}).get("machine", {})


def eval_dir(run_dir: Path, stage_id: str) -> str:
    return next(p.name for p in sorted((run_dir / "stages").iterdir()) if p.name.split("-", 1)[-1] == stage_id)


def rows(summary: dict[str, Any]) -> dict[str, tuple[float, float, float, bool, float]]:
    """Per key: (paired ratio, low, high, noisy, the stages' own figures' ratio)."""
    out = {}
    for key in KEYS:
        interval = summary["ratio_intervals"].get(key)
        if interval is None:
            raise SystemExit(f"busy_neighbour: the run has no side-by-side {key} (eval side_by_side off?)")
        apart = summary["final"][key] / summary["baseline"][key]
        out[key] = (summary["ratios"][key], interval["low"], interval["high"], interval["noisy"], apart)
    return out


def spinners(count: int, nice: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN, str(nice)]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="pipelines/k3.yaml")
    parser.add_argument("--runs-dir", default="runs", help="where the two run directories go")
    parser.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside the second run")
    parser.add_argument("--nice", type=int, default=0, choices=range(20),
                        help="their niceness (0: the pipeline's own priority; on 2 cores eager PyTorch's two threads "
                             "then wait at every op's barrier for the core a spinner holds, ~100x slower)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to both runs' opus run (e.g. workload.batch_size=8): the same for both")
    parser.add_argument("--quiet-run", help="a finished quiet run of the same pipeline to compare with, "
                        "instead of running one first")
    args = parser.parse_args()
    pipeline = (ROOT / args.pipeline).resolve() if not Path(args.pipeline).is_absolute() else Path(args.pipeline)
    if not pipeline.is_file():
        print(f"busy_neighbour: pipeline not found: {args.pipeline}", file=sys.stderr)
        raise SystemExit(2)
    if args.busy < 1:
        print(f"busy_neighbour: --busy must be 1 or more, got {args.busy}", file=sys.stderr)
        raise SystemExit(2)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = Path(args.runs_dir).resolve()
    quiet_dir, busy_dir = runs / f"busy-neighbour-{stamp}-quiet", runs / f"busy-neighbour-{stamp}-busy"
    if args.quiet_run:
        quiet_dir = Path(args.quiet_run).resolve()
        quiet = finished_summary(quiet_dir)
    else:
        print(f"busy_neighbour: {pipeline.name} quiet → {quiet_dir}", file=sys.stderr, flush=True)
        quiet = run_pipeline(pipeline, quiet_dir, None, args.set)
    print(f"busy_neighbour: again beside {args.busy} CPU-bound process(es) at nice {args.nice} → {busy_dir}",
          file=sys.stderr, flush=True)
    spinning = spinners(args.busy, args.nice)
    try:
        busy = run_pipeline(pipeline, busy_dir, quiet_dir, args.set)
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    stage = eval_dir(quiet_dir, quiet["final_stage"])
    print(f"\n{pipeline.name}, ratios of the optimized model to the unmodified one (os.cpu_count() = {os.cpu_count()})")
    print(f"{'run':<44}{'paired ratio [interval]':>34}{'stages apart':>14}   machine")
    beside = f"beside {args.busy} spinning (nice {args.nice})"
    for name, summary, run_dir in (("quiet", quiet, quiet_dir), (beside, busy, busy_dir)):
        machine = describe(eval_machine(run_dir, stage))
        for key, (ratio, low, high, noisy, apart) in rows(summary).items():
            mark = ", noisy" if noisy else ""
            print(f"{name + ' ' + KEYS[key]:<44}{f'×{ratio:.3f} [{low:.3f}–{high:.3f}{mark}]':>34}{f'×{apart:.3f}':>14}"
                  f"   {machine if key == 'throughput_tok_s' else ''}")
        if "seconds" in summary:
            print(f"{'':<44}{'':>34}{'':>14}   run {summary['seconds'] / 60:.1f} min")
    for key, label in KEYS.items():
        (_, q_low, q_high, _, _), (_, b_low, b_high, _, _) = rows(quiet)[key], rows(busy)[key]
        overlap = max(q_low, b_low) <= min(q_high, b_high)
        print(f"{label}: the paired intervals {'overlap' if overlap else 'do not overlap'} "
              f"([{q_low:.3f}–{q_high:.3f}] quiet, [{b_low:.3f}–{b_high:.3f}] busy)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the runs stopped with it (same process group); their checkpoints stay
        print("busy_neighbour: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
