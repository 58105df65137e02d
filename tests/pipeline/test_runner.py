"""The runner end to end with small fixture stages: checkpoints, keys, resume, gates, watchdog, lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from opus.pipeline.lock import RunLock
from tests.helpers import MEASURE, SCALE, events, pipeline, run_cli, statuses, summary, write_pipeline

CHAIN = [
    {"id": "base", "uses": MEASURE, "with": {"baseline": True, "throughput_tok_s": 100.0}},
    {"id": "first", "uses": SCALE, "needs": ["base"], "with": {"factor": 2.0}},
    {"id": "second", "uses": SCALE, "needs": ["first"], "with": {"factor": 3.0}},
]


def _final_tensors(run_dir: Path, stage: str) -> dict:
    (path,) = (run_dir / "stages").glob(f"*-{stage}")
    return load_file(str(path / "tensors.safetensors"))


def test_chain_checkpoints_every_stage(tmp_path: Path) -> None:
    path = write_pipeline(tmp_path / "p.yaml", pipeline(CHAIN))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    assert statuses(run_dir) == {"base": "done", "first": "done", "second": "done"}
    for stage in ("00-base", "01-first", "02-second"):
        assert (run_dir / "stages" / stage / "manifest.json").is_file()
    # Scaling by 2 then 3 multiplies every weight by 6 relative to the base model.
    from tests.fixtures.tiny import tiny_model

    base = tiny_model().state_dict()
    final = _final_tensors(run_dir, "second")
    for name, value in base.items():
        assert final[name].allclose(value * 6.0, rtol=1e-5)
    result = summary(run_dir)
    assert result["status"] == "finished" and result["rollbacks"] == []
    assert (run_dir / "pipeline.yaml").is_file() and (run_dir / "events.jsonl").is_file()


def test_changed_parameter_reruns_only_descendants(tmp_path: Path) -> None:
    path = write_pipeline(tmp_path / "p.yaml", pipeline(CHAIN))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    assert statuses(run_dir) == {"base": "cached", "first": "cached", "second": "cached"}
    assert run_cli("run", path, "--run-dir", run_dir, "--set", "stages.second.with.factor=5") == 0
    assert statuses(run_dir) == {"base": "cached", "first": "cached", "second": "done"}
    assert run_cli("run", path, "--run-dir", run_dir, "--set", "stages.first.with.factor=4") == 0
    assert statuses(run_dir) == {"base": "cached", "first": "done", "second": "done"}


def test_corrupted_checkpoint_is_discarded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_pipeline(tmp_path / "p.yaml", pipeline(CHAIN))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    tensors = run_dir / "stages" / "02-second" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0xFF
    tensors.unlink()  # break the hard link so only this checkpoint is damaged
    tensors.write_bytes(bytes(data))
    assert run_cli("resume", run_dir) == 0
    assert "checkpoint 02-second discarded" in capsys.readouterr().err
    assert statuses(run_dir) == {"base": "cached", "first": "cached", "second": "done"}
    discarded = [e for e in events(run_dir) if e["event"] == "checkpoint_discarded"]
    assert discarded[0]["stage"] == "second" and "sha256" in discarded[0]["reason"]
    assert any((run_dir / "discarded").iterdir())


def test_failed_gate_rolls_back_and_retries_with_remedy(tmp_path: Path) -> None:
    stages = [CHAIN[0], {"id": "q", "uses": SCALE, "needs": ["base"], "with": {"quality": 0.5},
                         "gate": {"quality": {"min": 0.9}}, "on_fail": "retry", "retries": 3}]
    path = write_pipeline(tmp_path / "p.yaml", pipeline(stages))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    result = summary(run_dir)
    rollbacks = result["rollbacks"]
    assert [r["measured"] for r in rollbacks] == [0.5, 0.75]
    first = rollbacks[0]
    assert first["metric"] == "quality" and first["bound"] == "min" and first["threshold"] == 0.9
    assert first["remedy"] == {"quality": {"from": 0.5, "to": 0.75}} and first["action"] == "retry"
    assert first["restored"] == "00-base"
    stage = next(s for s in result["stages"] if s["id"] == "q")
    assert stage["status"] == "done" and stage["attempts"] == 3 and stage["metrics"]["quality"] == 1.0


def test_failed_gate_skip_keeps_previous_state(tmp_path: Path) -> None:
    stages = [*CHAIN[:2], {"id": "bad", "uses": SCALE, "needs": ["first"], "with": {"factor": 10.0},
                           "gate": {"throughput": {"min_ratio": 2.0}}, "on_fail": "skip"},
              {"id": "after", "uses": SCALE, "needs": ["bad"], "with": {"factor": 0.5}}]
    path = write_pipeline(tmp_path / "p.yaml", pipeline(stages))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 4  # degraded: a stage was skipped
    assert summary(run_dir)["status"] == "degraded"
    assert statuses(run_dir) == {"base": "done", "first": "done", "bad": "rolled_back", "after": "done"}
    (rollback,) = summary(run_dir)["rollbacks"]
    assert rollback["metric"] == "throughput_tok_s" and rollback["reason"].startswith("the stage did not report")
    first = _final_tensors(run_dir, "first")
    after = _final_tensors(run_dir, "after")
    for name in first:  # 'bad' was rolled back: 'after' started from 'first'
        assert after[name].allclose(first[name] * 0.5)
    # Resume does not redo a stage its gate rolled back: the verdict would repeat.
    assert run_cli("resume", run_dir) == 4
    assert statuses(run_dir)["bad"] == "rolled_back"
    assert sum(e["event"] == "stage_started" and e["stage"] == "bad" for e in events(run_dir)) == 1


def test_relative_gate_against_baseline_and_abort(tmp_path: Path) -> None:
    stages = [CHAIN[0], {"id": "slow", "uses": MEASURE, "needs": ["base"], "with": {"throughput_tok_s": 150.0},
                         "gate": {"throughput": {"min_ratio": 2.0}}, "on_fail": "abort"},
              {"id": "never", "uses": MEASURE, "needs": ["slow"]}]
    path = write_pipeline(tmp_path / "p.yaml", pipeline(stages))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 3
    result = summary(run_dir)
    assert result["status"] == "failed" and "on_fail is abort" in result["error"]
    (rollback,) = result["rollbacks"]
    assert rollback["baseline"] == 100.0 and rollback["measured"] == 150.0 and rollback["action"] == "abort"
    assert statuses(run_dir) == {"base": "done", "slow": "failed", "never": "skipped"}


def test_crash_is_recorded_and_skipped(tmp_path: Path) -> None:
    stages = [CHAIN[0], {"id": "boom", "uses": SCALE, "needs": ["base"], "with": {"crash": True}},
              {"id": "next", "uses": MEASURE, "needs": ["boom"]}]
    path = write_pipeline(tmp_path / "p.yaml", pipeline(stages))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 3  # failed: the only transforming stage crashed
    assert "no model-transforming stage survived" in summary(run_dir)["reasons"][0]
    (rollback,) = summary(run_dir)["rollbacks"]
    assert rollback["kind"] == "crash" and "crashed on purpose" in rollback["reason"]
    assert statuses(run_dir)["next"] == "done"


def test_watchdog_stops_a_hung_stage(tmp_path: Path) -> None:
    stages = [CHAIN[0], {"id": "hang", "uses": SCALE, "needs": ["base"], "with": {"hang": True}}]
    spec = pipeline(stages)
    spec["run"] = {"stall_timeout_s": 10}  # above a worker's start-up (imports) on a busy CI machine
    path = write_pipeline(tmp_path / "p.yaml", spec)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    assert run_cli("run", path, "--run-dir", run_dir) == 3
    assert time.monotonic() - started < 60
    (rollback,) = summary(run_dir)["rollbacks"]
    assert rollback["kind"] == "stalled" and "no progress for 10 s (last: scaling 1/1)" in rollback["reason"]


def test_watchdog_waits_longer_inside_a_compile(tmp_path: Path) -> None:
    # Silent past stall_timeout_s inside a compile: not a stall; past compile_timeout_s: stopped, and said so.
    hung = {"id": "compiles", "uses": SCALE, "needs": ["base"], "with": {"compile_s": 600}}
    spec = pipeline([CHAIN[0], hung], run={"stall_timeout_s": 10, "compile_timeout_s": 12})
    run_dir = tmp_path / "run"
    assert run_cli("run", write_pipeline(tmp_path / "p.yaml", spec), "--run-dir", run_dir) == 3
    (rollback,) = summary(run_dir)["rollbacks"]
    assert rollback["kind"] == "stalled" and "torch compiled for 12 s without finishing" in rollback["reason"]


def test_second_process_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_pipeline(tmp_path / "p.yaml", pipeline(CHAIN[:1]))
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        # The lock is per open file description, so this in-process attempt is refused like another process.
        assert run_cli("run", path, "--run-dir", run_dir) == 2
    assert "in use by pid" in capsys.readouterr().err


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_sigkill_mid_stage_then_resume_matches_uninterrupted(tmp_path: Path, repo_root: Path) -> None:
    stages = [CHAIN[0], CHAIN[1], {"id": "slow", "uses": SCALE, "needs": ["first"],
                                   "with": {"factor": 1.5, "steps": 30, "step_s": 0.1}},
              {"id": "last", "uses": SCALE, "needs": ["slow"], "with": {"factor": 0.5}}]
    path = write_pipeline(tmp_path / "p.yaml", pipeline(stages))
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = subprocess.Popen([sys.executable, "-m", "opus.cli.main", "run", str(path), "--run-dir", str(killed),
                             "--quiet"], cwd=repo_root, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = killed / "logs" / "02-slow.log"
    _wait_for(lambda: (killed / "events.jsonl").is_file()
              and any(e["event"] == "stage_started" and e["stage"] == "slow" for e in events(killed)))
    time.sleep(1.0)
    assert run_cli("resume", killed) == 2  # the running process holds the run directory
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and its worker, as a power cut would
    proc.wait()
    assert log.is_file() and not (killed / "summary.json").exists()
    assert run_cli("resume", killed) == 0
    assert statuses(killed) == {"base": "cached", "first": "cached", "slow": "done", "last": "done"}
    assert not list((killed / "stages").glob(".tmp-*"))
    assert run_cli("run", path, "--run-dir", clean) == 0
    a, b = _final_tensors(killed, "last"), _final_tensors(clean, "last")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    metrics = lambda d: {s["id"]: s["metrics"] for s in summary(d)["stages"]}  # noqa: E731
    assert metrics(killed) == metrics(clean)


def test_auto_threads_run_each_stage_on_the_cores_idle_before_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """run.threads: auto counts the idle cores before every stage; a neighbour holding one core of two
    leaves one thread, which the stage's worker runs with and the events record."""
    from opus.runtime import machine

    monkeypatch.setattr(machine, "idle_cores", lambda: 1.0)
    stages = [{"id": "base", "uses": MEASURE, "with": {"baseline": True, "report_threads": True}},
              {"id": "after", "uses": MEASURE, "needs": ["base"], "with": {"report_threads": True}}]
    path = write_pipeline(tmp_path / "p.yaml", pipeline(stages, run={"stall_timeout_s": 60, "threads": "auto"}))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    assert [s["metrics"]["threads"] for s in summary(run_dir)["stages"]] == [1, 1]
    chosen = [e for e in events(run_dir) if e["event"] == "stage_threads"]
    assert [(e["stage"], e["threads"], e["idle_cores"]) for e in chosen] == [("base", 1, 1.0), ("after", 1, 1.0)]


def test_the_engine_keeps_progress_json_whatever_observes_it(tmp_path: Path) -> None:
    """No display at all (the Python API, a service): the runner still writes progress.json for `opus
    status`, and its observer hears begin, then each stage started before finished."""
    from opus.atomic import read_json
    from opus.pipeline.events import Unobserved
    from opus.pipeline.runner import Runner
    from opus.pipeline.spec import load_pipeline

    class Recorder(Unobserved):
        def __init__(self) -> None:
            self.calls: list[tuple[str, ...]] = []

        def begin(self, stage_ids: list[str]) -> None:
            self.calls.append(("begin", *stage_ids))

        def started(self, stage_id: str, uses: str, attempt: int) -> None:
            self.calls.append(("started", stage_id))

        def finished(self, stage_id: str, status: str, metrics: dict, seconds: float | None, note: str = "") -> None:
            self.calls.append(("finished", stage_id, status))

    path = write_pipeline(tmp_path / "p.yaml", pipeline(CHAIN[:2]))
    recorder = Recorder()
    result = Runner(load_pipeline(path), tmp_path / "run", recorder).run()
    assert result["status"] == "finished"
    assert recorder.calls == [("begin", "base", "first"), ("started", "base"), ("finished", "base", "done"),
                              ("started", "first"), ("finished", "first", "done")]
    progress = read_json(tmp_path / "run" / "progress.json")
    assert progress["running"] == [] and progress["stages"] == ["base", "first"]
    assert {stage: entry["status"] for stage, entry in progress["finished"].items()} == {"base": "done",
                                                                                        "first": "done"}
