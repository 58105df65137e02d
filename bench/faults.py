"""Faults: what an Opus run directory survives, in figures (issue 13, item 5).

Parts (``--only``, comma-separated; all by default), each printed as a table, then a summary:

- ``kill``    SIGKILL ``opus run``'s process group at ``--kills`` random instants (``--seed``) within the
              measured duration of an uninterrupted run, then ``opus resume`` until exit 0. Claims: it
              finishes; no stage committed before the kill starts again; the final quality metrics
              (perplexity, agreement, top1_accuracy, logits_cosine) and plan equal the uninterrupted run's.
- ``repeat``  a second uninterrupted run: the same plan.yaml choices, timing decisions, recipe, quality.
- ``damage``  on copies of the finished reference run, one kind of damage each to one stage
              (``--damage-stage``; default quantize, else the first with tensors): truncated or bit-flipped
              tensors, edited state/result/manifest, a manifest with another key, no manifest. Claims:
              ``opus verify`` exits 3; the resume detects it, moves it to discarded/, rebuilds it, and
              recomputes each other stage exactly when one of its inputs' content digests changed.
- ``disk``    Linux, root: per stage and per ``--slack-kb`` level (default 64,0), a run on a tmpfs
              that is filled, all but that many KiB, the moment the stage starts; the runs use
              ``--set run.min_free_disk_mb=1`` (the default 256 MiB reserve does not fit a small
              tmpfs). Claims: exit 3 with a 'disk' rollback (or the run finishes when what was left
              fit), every checkpoint committed before still verifies, a resume of a copy on a larger
              disk finishes without computing them again.

opus runs from a snapshot of opus/, stages/ and the test fixtures taken at the start (keys hash the
opus sources: an edit to the checkout during the campaign would change every key); ``--live-code``
runs the checkout itself.

    python bench/faults.py                          # pipelines/smoke.yaml, 20 kills, all parts
    python bench/faults.py --pipeline tiny          # the runner tests' fixture stages: minutes
    python bench/faults.py --kills 2 --only kill --out /tmp/faults
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing Opus
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fault_parts as fp  # noqa: E402

PARTS = ("kill", "repeat", "damage", "disk")
MAX_RESUMES = 3


@dataclass
class Campaign:
    pipeline: Path
    sets: list[str]
    out: Path
    args: argparse.Namespace
    ref: Path = Path()
    seconds: float = 0.0  # one uninterrupted run
    resume_s: float = 0.0  # a resume that redoes nothing
    verify_s: float = 0.0
    timeout: float = 600.0
    claims: list[str] = field(default_factory=list)

    def run_args(self, run_dir: Path, *extra: str) -> list[Any]:
        return ["run", self.pipeline, "--run-dir", run_dir, *self.sets, *extra, "--quiet"]

    def claim(self, text: str, held: int, total: int) -> None:
        self.claims.append(f"{'ok  ' if held == total else 'FAIL'} {text}: {held}/{total}")


def finish(c: Campaign, run_dir: Path, *extra: str) -> tuple[int, int, str]:
    """``opus resume`` (``opus run`` again before run.json exists) until exit 0: (exit, resumes, stderr)."""
    rc, resumes, err = -1, 0, ""
    while rc != 0 and resumes < MAX_RESUMES:
        args = ["resume", run_dir, "--quiet"] if (run_dir / "run.json").is_file() else c.run_args(run_dir, *extra)
        call = fp.opus(*args, timeout=c.timeout)
        rc, resumes, err = call.rc, resumes + 1, err + call.err
    return rc, resumes, err


def _fmt_s(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


# -- reference and estimate -------------------------------------------------------------------------
def reference(c: Campaign) -> bool:
    c.ref = c.out / "reference"
    call = fp.opus(*c.run_args(c.ref), timeout=None)
    c.seconds = call.seconds
    if call.rc != 0:
        print(f"reference run failed (exit {call.rc}): {call.err.strip()[-2000:]}")
        return False
    c.timeout = max(300.0, 5 * c.seconds)
    started = len(fp.events(c.ref))
    noop = fp.opus("resume", c.ref, "--quiet", timeout=c.timeout)
    redone = [e["stage"] for e in fp.events(c.ref)[started:] if e.get("event") == "stage_started"]
    verify = fp.opus("verify", c.ref, timeout=c.timeout)
    c.resume_s, c.verify_s = noop.seconds, verify.seconds
    stages = fp.summary(c.ref)["stages"]
    print(f"\nreference run: {_fmt_s(c.seconds)} (exit {call.rc}); stages: "
          + ", ".join(f"{s['id']} {s.get('duration_s') or 0:.1f} s" for s in stages))
    print(f"  final quality: {fp.quality(c.ref) or 'none'}")
    print(f"  a resume of the finished run: {noop.seconds:.1f} s, exit {noop.rc}, stages computed again: "
          f"{', '.join(redone) or 'none'}; opus verify: exit {verify.rc} ({verify.seconds:.1f} s)")
    return True


def estimate(c: Campaign, parts: list[str]) -> None:
    durations = [s.get("duration_s") or 0.0 for s in fp.summary(c.ref)["stages"]]
    mean_stage = sum(durations) / max(1, len(durations))

    def per(kills: int, slacks: int) -> dict[str, float]:
        return {"repeat": c.seconds, "kill": kills * (c.seconds + c.resume_s + mean_stage / 2 + c.verify_s),
                "damage": len(fp.DAMAGE_KINDS) * (c.verify_s + c.resume_s + c.seconds / 2),
                "disk": slacks * len(durations) * (c.seconds + c.resume_s + 2 * c.verify_s)}

    asked, full = per(c.args.kills, len(c.args.slack_kb)), per(20, 2)
    print(f"estimated duration of the parts asked for: {_fmt_s(sum(asked[p] for p in parts))} ("
          + ", ".join(f"{p} ~{_fmt_s(asked[p])}" for p in parts) + "); the full campaign (all parts, 20 kills, "
          f"--slack-kb 64,0) on this machine: ~{_fmt_s(sum(full.values()) + c.seconds)} ("
          + ", ".join(f"{p} ~{_fmt_s(v)}" for p, v in full.items()) + ")", flush=True)


# -- kill -----------------------------------------------------------------------------------------
def _running(before: list[dict[str, Any]]) -> str:
    running = "start-up"
    for e in before:
        if (kind := e.get("event", "")) == "stage_started":
            running = e["stage"]
        elif kind in ("stage_done", "stage_cached", "stage_rolled_back", "rollback") and e.get("stage") == running:
            running = f"after {running}"
        elif kind.startswith("run_") and kind not in ("run_started", "run_resumed"):
            running = "after the run ended"
    return running


def kill_trial(c: Campaign, n: int, at: float) -> dict[str, Any]:
    run_dir = c.out / "kill" / f"{n:02d}"
    proc = fp.spawn(*c.run_args(run_dir), log=c.out / "kill" / f"{n:02d}.log")
    try:
        proc.wait(timeout=at)
        killed, orphans = False, []
    except subprocess.TimeoutExpired:
        group = fp.processes_of(proc.pid, run_dir)
        fp.kill_group(proc.pid)
        proc.wait()
        killed, orphans = True, fp.wait_gone(group | fp.processes_of(proc.pid, run_dir))
    before, done_before = fp.events(run_dir), fp.committed(run_dir)
    rc, resumes, _ = finish(c, run_dir)
    after = fp.events(run_dir)[len(before):]
    again = sorted({e["stage"] for e in after if e.get("event") == "stage_started"} & set(done_before))
    verify = fp.opus("verify", run_dir, timeout=c.timeout) if rc == 0 else None
    outcome = fp.compare(c.ref, run_dir)
    row = {"n": n, "at": at, "killed": killed, "during": _running(before) if killed else "not killed (ended)",
           "committed": len(done_before), "resumes": resumes, "rc": rc, "again": again, "orphans": orphans,
           "verify": verify.rc if verify else "-", **outcome}
    if not c.args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def kill_part(c: Campaign) -> None:
    rng = random.Random(c.args.seed)
    instants = [round(rng.uniform(0.0, c.seconds), 2) for _ in range(c.args.kills)]
    rows = []
    for n, at in enumerate(instants):
        rows.append(kill_trial(c, n, at))
        r = rows[-1]
        print(f"  kill {n + 1}/{len(instants)} at {at:.1f} s during {r['during']}: exit {r['rc']} after "
              f"{r['resumes']} resume(s); quality {r['quality']}", flush=True)
    fp.table(f"kill: SIGKILL at {len(rows)} random instants within {c.seconds:.1f} s (seed {c.args.seed}), "
             "then opus resume until exit 0",
             ["#", "kill at", "during", "committed", "resumes", "exit", "verify", "committed stages computed again",
              "orphans", "final quality vs uninterrupted", "plan", "recipe"],
             [[r["n"], f"{r['at']:.1f} s", r["during"], r["committed"], r["resumes"], r["rc"], r["verify"],
               ", ".join(r["again"]) or "none", len(r["orphans"]), r["quality"], r["plan"], r["recipe"]]
              for r in rows])
    n = len(rows)
    print(f"  {sum(r['killed'] for r in rows)} of {n} trials killed mid-run; the others ended before their instant")
    c.claim("kill: resumes finished (exit 0)", sum(r["rc"] == 0 for r in rows), n)
    c.claim("kill: no committed stage computed again", sum(not r["again"] for r in rows), n)
    c.claim("kill: final quality identical to the uninterrupted run", sum(r["quality"] == "identical" for r in rows), n)
    if fp.plan_choices(c.ref)[1] is not None:
        c.claim("kill: plan identical to the uninterrupted run", sum(r["plan"][:9] == "identical" for r in rows), n)
    c.claim("kill: no worker outlived the killed run", sum(not r["orphans"] for r in rows), n)


# -- repeat ---------------------------------------------------------------------------------------
def repeat_part(c: Campaign) -> None:
    run_dir = c.out / "repeat"
    call = fp.opus(*c.run_args(run_dir), timeout=c.timeout)
    plan_a, choices_a = fp.plan_choices(c.ref)
    plan_b, choices_b = fp.plan_choices(run_dir)
    where = fp.leaf_diffs(plan_a, plan_b)
    decided = sorted(p for p in where if not any(t in p for t in fp.TIMINGS))
    dec_a, dec_b = fp.decisions(c.ref), fp.decisions(run_dir)
    differ = [k for k in dec_a if dec_a[k] != dec_b.get(k)]
    sums_a, sums_b = fp.tensor_sums(c.ref), fp.tensor_sums(run_dir)
    other_tensors = [s for s in sums_a if sums_a[s] != sums_b.get(s)]
    outcome = fp.compare(c.ref, run_dir)
    rows = [["exit code of the second run", call.rc, f"{_fmt_s(call.seconds)}"],
            ["plan.yaml, every field", "n/a" if plan_a is None else "identical" if not where else "differs",
             ", ".join(sorted(where)[:8]) + (" ..." if len(where) > 8 else "")],
            ["plan.yaml but its timings", "n/a" if plan_a is None else "identical" if not decided else "differs",
             "" if plan_a is None else f"fields naming {', '.join(fp.TIMINGS)} left out; " + ", ".join(decided)],
            ["plan.yaml choices (group → format)", outcome["plan"], ""],
            ["timing decisions (decisions.json winners)", f"{len(dec_a) - len(differ)}/{len(dec_a)} the same",
             "; ".join(f"{k}: {dec_a[k]} vs {dec_b.get(k)}" for k in differ)],
            ["final recipe (state.json)", outcome["recipe"], ""],
            ["final quality metrics", outcome["quality"], ""],
            ["tensors per stage (sha256)", "identical" if not other_tensors else "differ", ", ".join(other_tensors)]]
    fp.table("repeat: two uninterrupted runs", ["what", "same?", "detail"], rows)
    if choices_a is not None:
        c.claim("repeat: identical plan.yaml choices", int(choices_a == choices_b), 1)
        c.claim("repeat: identical plan.yaml but for its measured timings", int(not decided), 1)
    c.claims.append(f"info repeat: timing decisions with the same winner (kernel views included): "
                    f"{len(dec_a) - len(differ)}/{len(dec_a)}; final recipe {outcome['recipe']}")
    c.claim("repeat: identical final quality", int(outcome["quality"] == "identical"), 1)


# -- damage ---------------------------------------------------------------------------------------
def damage_trial(c: Campaign, target: str, kind: str, ref_digests: dict[str, str]) -> list[Any]:
    run_dir = c.out / "damage" / kind
    shutil.copytree(c.ref, run_dir, symlinks=True)
    what = fp.damage(fp.stage_dir(run_dir, target), kind)  # type: ignore[arg-type]
    if what.startswith("n/a"):
        return [kind, what] + ["-"] * 8
    seen = len(fp.events(run_dir))
    verify = fp.opus("verify", run_dir, timeout=c.timeout)
    said = next((line.split(None, 2) for line in verify.out.splitlines() if line.startswith(f"{target} ")), [])
    rc, resumes, err = finish(c, run_dir)
    after = fp.events(run_dir)[seen:]
    event = any(e.get("event") == "checkpoint_discarded" and e.get("stage") == target for e in after)
    aside = sorted(p.name for p in (run_dir / "discarded").iterdir()) if (run_dir / "discarded").is_dir() else []
    states, digests = fp.statuses(run_dir), fp.digests_of(run_dir)
    order, wrong = fp.pipeline_order(run_dir), []
    below = fp.descendants(order, target)
    for sid, _, needs in (o for o in order if o[0] != target):
        changed = any(digests.get(n) != ref_digests.get(n) for n in needs)
        if states.get(sid) != ("done" if changed else "cached"):
            wrong.append(f"{sid} {states.get(sid)} (inputs {'changed' if changed else 'same'})")
    row = [kind, what, f"{verify.rc}: {' '.join(said[1:])}"[:70], f"{'warning' if 'discarded' in err else '-'}"
           f"+{'event' if event else '-'}", ", ".join(aside) or "-", f"{states.get(target)} (exit {rc}, {resumes}x)",
           "yes" if digests.get(target) == ref_digests.get(target) else "no",
           ", ".join(s for s in below if states.get(s) == "done") or "none",
           ", ".join(s for s in below if states.get(s) == "cached") or "none",
           "yes" if not wrong else "NO: " + "; ".join(wrong)]
    if not c.args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def damage_part(c: Campaign) -> None:
    target = c.args.damage_stage or fp.default_target(c.ref)
    ref_digests = fp.digests_of(c.ref)
    rows = [damage_trial(c, target, kind, ref_digests) for kind in fp.DAMAGE_KINDS]
    fp.table(f"damage: one kind at a time to stage '{target}' of a copy of the finished reference run, "
             "then opus verify and opus resume",
             ["kind", "damage", "opus verify: exit, action for it", "detected", "moved aside (discarded/)",
              "rebuilt", "same content as before", "descendants recomputed", "descendants reused",
              "recomputed exactly when inputs changed"], rows)
    print("  'same content': the rebuilt checkpoint's content digest (key, file hashes but job/result, metrics)\n"
          "  equals the undamaged one's; a stage must be recomputed iff one of its inputs' digests changed.")
    tried = [r for r in rows if r[2] != "-"]
    damaged = [r for r in tried if r[0] != "manifest-key"]  # another key is a stale checkpoint, not damage
    c.claim("damage: detected by opus verify (exit 3)", sum(r[2].startswith("3") for r in tried), len(tried))
    c.claim("damage: detected on resume and moved aside", sum(r[3] == "warning+event" and r[4] != "-" for r in damaged),
            len(damaged))
    c.claim("damage: rebuilt and the resume finished", sum(r[5].startswith("done (exit 0") for r in tried), len(tried))
    c.claim("damage: others recomputed exactly when their inputs changed", sum(r[9] == "yes" for r in tried),
            len(tried))


# -- full disk --------------------------------------------------------------------------------------
def disk_trial(c: Campaign, sid: str, mnt: Path, size_mb: int, slack_kb: int) -> dict[str, Any]:
    why = fp.mount_tmpfs(mnt, size_mb)
    if why:
        return {"stage": sid, "skipped": why}
    run_dir, big = mnt / "run", c.out / "disk" / f"{slack_kb}k-{sid}"
    log = c.out / "disk" / f"{slack_kb}k-{sid}.log"
    try:
        proc = fp.spawn(*c.run_args(run_dir, "--set", "run.min_free_disk_mb=1"), log=log)
        reached = fp.wait_for_event(proc, run_dir, "stage_started", sid, c.timeout)
        taken = fp.fill(mnt, slack_kb * 1024) if reached else 0
        at_fill = fp.committed(run_dir)
        try:
            rc = proc.wait(timeout=c.timeout)
        except subprocess.TimeoutExpired:
            fp.kill_group(proc.pid)
            rc = proc.wait()
        rollbacks = [f"{r['stage']} {r['kind']}" + (" (worker)" if "(log: " in r["reason"] else " (runner)")
                     for r in fp.events(run_dir) if r.get("event") == "rollback"]
        text = log.read_text(errors="replace")
        crash = next((line for line in reversed(text.splitlines()) if line.startswith(("OSError", "opus."))), "")
        verify = fp.opus("verify", run_dir, timeout=c.timeout)
        reused = {line.split()[0] for line in verify.out.splitlines() if line.split()[1:2] == ["reuse"]}
        kept = [s for s in at_fill if s in reused and fp.committed(run_dir).get(s) == at_fill[s]]
        (mnt / "filler").unlink(missing_ok=True)
        shutil.copytree(run_dir, big, symlinks=True)
    finally:
        fp.unmount(mnt)
    rc2, resumes, _ = finish(c, big, "--set", "run.min_free_disk_mb=1")
    states = fp.statuses(big)
    row = {"stage": sid, "filled": f"{taken / 2**20:.0f} MiB at its start" if reached else "never started",
           "rc": rc, "rollbacks": ", ".join(rollbacks) or "none",
           "traceback": crash[:90] if "Traceback" in text else "no", "committed": len(at_fill),
           "intact": len(kept) == len(at_fill), "still verify": f"{len(kept)} of {len(at_fill)}",
           "resume": f"exit {rc2} ({resumes}x)", "again": [s for s in at_fill if states.get(s) != "cached"],
           "quality": fp.compare(c.ref, big)["quality"]}
    row["outcome"] = ("stopped: exit 3, disk rollback" if rc == 3 and " disk " in row["rollbacks"] + " "
                      else "finished: what was left fit" if rc == 0 else f"exit {rc}")
    if not c.args.keep:
        shutil.rmtree(big, ignore_errors=True)
    return row


def disk_part(c: Campaign) -> None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        print("\n== disk: skipped: needs Linux and root to mount a tmpfs ==")
        c.claims.append("skip disk: needs Linux and root")
        return
    order = [sid for sid, _, _ in fp.pipeline_order(c.ref)]
    size_mb = math.ceil(fp.disk_bytes(c.ref) * 1.5 / 2**20) + 16
    mnt = c.out / "disk" / "mnt"
    for slack in c.args.slack_kb:
        rows = []
        for sid in order:
            rows.append(disk_trial(c, sid, mnt, size_mb, slack))
            r = rows[-1]
            if "skipped" in r:
                print(f"\n== disk: {r['skipped']} ==")
                c.claims.append(f"skip disk: {r['skipped']}")
                return
            print(f"  disk full ({slack} KiB left) at {sid}: {r['outcome']}; resume on a larger disk: {r['resume']}",
                  flush=True)
        fp.table(f"disk: a {size_mb} MiB tmpfs filled to all but {slack} KiB when the stage starts "
                 "(runs with --set run.min_free_disk_mb=1), then the run copied to a larger disk and resumed",
                 ["stage", "filled", "outcome", "rollbacks (stage kind, by)", "traceback", "committed before",
                  "still verify", "resume on a larger disk", "committed stages computed again",
                  "final quality vs uninterrupted"],
                 [[r["stage"], r["filled"], r["outcome"], r["rollbacks"], r["traceback"], r["committed"],
                   r["still verify"], r["resume"], ", ".join(r["again"]) or "none", r["quality"]] for r in rows])
        n = len(rows)
        c.claim(f"disk ({slack} KiB left): exit 3 with a 'disk' rollback, or finished (what was left fit)",
                sum(r["outcome"].startswith(("stopped", "finished")) for r in rows), n)
        c.claim(f"disk ({slack} KiB left): committed checkpoints intact", sum(r["intact"] for r in rows), n)
        c.claim(f"disk ({slack} KiB left): a resume on a larger disk finished",
                sum(r["resume"].startswith("exit 0") for r in rows), n)
        c.claim(f"disk ({slack} KiB left): no committed stage computed again", sum(not r["again"] for r in rows), n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", default="pipelines/smoke.yaml",
                        help="a pipeline file, or 'tiny' for the runner tests' fixture stages")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every opus run")
    parser.add_argument("--damage-stage", help="the stage to damage (default: quantize, else the first with tensors)")
    parser.add_argument("--slack-kb", type=lambda v: [int(x) for x in v.split(",")], default=[64, 0],
                        help="free KiB left on the filled tmpfs, comma-separated: one disk part each (default 64,0)")
    parser.add_argument("--keep", action="store_true", help="keep every trial's run directory")
    parser.add_argument("--live-code", action="store_true",
                        help="run opus from the checkout itself, not from a snapshot of it taken at the start")
    args = parser.parse_args(argv)
    if unknown := set(parts := [p.strip() for p in args.only.split(",") if p.strip()]) - set(PARTS):
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    out = (args.out or Path(tempfile.mkdtemp(prefix="opus-faults-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    given = Path(args.pipeline)
    pipeline = fp.tiny_pipeline(out / "tiny.yaml") if args.pipeline == "tiny" else (
        given if given.exists() else fp.ROOT / given).resolve()
    c = Campaign(pipeline, [x for kv in args.overrides for x in ("--set", kv)], out, args)
    print(fp.machine())
    if not args.live_code:
        print(fp.snapshot_code(out / "code"))
        sys.path.insert(0, str(out / "code"))  # digests_of: the snapshot's content_digest
    print(f"pipeline {pipeline}; parts {', '.join(parts)}; kills {args.kills}; seed {args.seed}; runs under {out}")
    started = time.monotonic()
    if not reference(c):
        return 3
    estimate(c, parts)
    for part in parts:
        begun = time.monotonic()
        {"kill": kill_part, "repeat": repeat_part, "damage": damage_part, "disk": disk_part}[part](c)
        print(f"  ({part}: {_fmt_s(time.monotonic() - begun)})", flush=True)
    print(f"\n== summary ({_fmt_s(time.monotonic() - started)} in all; one uninterrupted run {_fmt_s(c.seconds)}) ==")
    for line in c.claims:
        print("  " + line)
    return 0 if not any(line.startswith("FAIL") for line in c.claims) else 1


if __name__ == "__main__":
    sys.exit(main())
