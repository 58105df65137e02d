"""Integrity under faults: content-addressed lineage, retry on resume, nothing outlives a stage, disk."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import MEASURE, SCALE, events, pipeline, run_cli, statuses, summary, write_pipeline

BASE = {"id": "base", "uses": MEASURE, "with": {"baseline": True}}


def _pipeline(tmp_path: Path, stages: list[dict], **run: object) -> Path:
    spec = pipeline(stages)
    spec["run"].update(run)
    return write_pipeline(tmp_path / "p.yaml", spec)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.unlink()  # break the hard link so only this checkpoint is damaged
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("noise", "second"), [(True, "done"), (False, "cached")])
def test_rebuilt_input_reruns_descendants_exactly_when_its_content_changed(tmp_path: Path, noise: bool,
                                                                           second: str) -> None:
    stages = [BASE, {"id": "first", "uses": SCALE, "needs": ["base"], "with": {"noise": noise}},
              {"id": "second", "uses": SCALE, "needs": ["first"], "with": {"factor": 3.0}}]
    run_dir = tmp_path / "run"
    assert run_cli("run", _pipeline(tmp_path, stages), "--run-dir", run_dir) == 0
    _flip_byte(run_dir / "stages" / "01-first" / "tensors.safetensors")
    assert run_cli("resume", run_dir) == 0
    # A rebuild with fresh noise is another model: 'second' must not be reused on top of it.
    assert statuses(run_dir) == {"base": "cached", "first": "done", "second": second}


def test_missing_manifest_is_moved_aside_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stages = [BASE, {"id": "first", "uses": SCALE, "needs": ["base"]}]
    run_dir = tmp_path / "run"
    assert run_cli("run", _pipeline(tmp_path, stages), "--run-dir", run_dir) == 0
    (run_dir / "stages" / "01-first" / "manifest.json").unlink()
    assert run_cli("resume", run_dir) == 0
    assert "checkpoint 01-first discarded: no readable manifest.json" in capsys.readouterr().err
    assert [p.name.split("-")[1] for p in (run_dir / "discarded").iterdir()] == ["first"]
    assert statuses(run_dir)["first"] == "done"


def test_verify_says_what_a_resume_would_redo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stages = [BASE, {"id": "first", "uses": SCALE, "needs": ["base"]},
              {"id": "second", "uses": SCALE, "needs": ["first"]}]
    run_dir = tmp_path / "run"
    assert run_cli("run", _pipeline(tmp_path, stages), "--run-dir", run_dir) == 0
    capsys.readouterr()
    assert run_cli("verify", run_dir) == 0
    assert "a resume would redo nothing" in capsys.readouterr().out
    _flip_byte(run_dir / "stages" / "01-first" / "tensors.safetensors")
    before = sorted(p.name for p in (run_dir / "stages").iterdir())
    assert run_cli("verify", run_dir) == 3
    out = capsys.readouterr().out
    assert "first                recompute  damaged: tensors.safetensors does not match its sha256" in out
    assert "second               recompute  its input 'first' is rebuilt" in out
    assert sorted(p.name for p in (run_dir / "stages").iterdir()) == before  # read-only


def test_verify_names_what_changed_in_a_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stages = [BASE, {"id": "first", "uses": SCALE, "needs": ["base"]},
              {"id": "second", "uses": SCALE, "needs": ["first"]}]
    run_dir = tmp_path / "run"
    assert run_cli("run", _pipeline(tmp_path, stages), "--run-dir", run_dir) == 0
    as_run = run_dir / "pipeline.yaml"  # what resume and verify read
    spec = yaml.safe_load(as_run.read_text())
    spec["stages"][2]["with"] = {"factor": 4.0}
    as_run.write_text(yaml.safe_dump(spec, sort_keys=False))
    capsys.readouterr()
    assert run_cli("verify", run_dir) == 3
    out = capsys.readouterr().out
    assert "second               recompute  its checkpoint 02-second was made with another definition" in out
    assert "first                reuse" in out


def test_transient_rollback_is_retried_on_resume_and_its_record_kept(tmp_path: Path) -> None:
    flag = tmp_path / "disk-is-back"
    stages = [BASE, {"id": "first", "uses": SCALE, "needs": ["base"]},
              {"id": "flaky", "uses": SCALE, "needs": ["first"], "with": {"crash_unless": str(flag)}}]
    run_dir = tmp_path / "run"
    assert run_cli("run", _pipeline(tmp_path, stages), "--run-dir", run_dir) == 4
    flag.touch()
    assert run_cli("resume", run_dir) == 0
    result = summary(run_dir)
    assert result["status"] == "finished" and statuses(run_dir)["flaky"] == "done"
    (rollback,) = result["rollbacks"]  # history: it did fail once, and why
    assert rollback["kind"] == "crash" and rollback["stage"] == "flaky" and rollback["time"] > 0
    assert [e["stage"] for e in events(run_dir) if e["event"] == "stage_retried_on_resume"] == ["flaky"]


def test_stopping_a_stage_stops_what_it_started(tmp_path: Path) -> None:
    trace = tmp_path / "child-writes"
    stages = [BASE, {"id": "first", "uses": SCALE, "needs": ["base"]},
              {"id": "hang", "uses": SCALE, "needs": ["first"], "with": {"stubborn_child": str(trace), "hang": True}}]
    run_dir = tmp_path / "run"
    # 10 s: above a worker's start-up (importing torch) on a busy CI machine, where 3 s stalled 'first' too.
    assert run_cli("run", _pipeline(tmp_path, stages, stall_timeout_s=10), "--run-dir", run_dir) == 4
    pid = int(Path(f"{trace}.pid").read_text())
    size = trace.stat().st_size
    time.sleep(0.5)
    assert trace.stat().st_size == size, "the grandchild kept writing after the stage was stopped"
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_disk_is_checked_before_the_stage_computes_and_resume_finishes(tmp_path: Path) -> None:
    stages = [BASE, {"id": "first", "uses": SCALE, "needs": ["base"]}]
    run_dir = tmp_path / "run"
    path = _pipeline(tmp_path, stages)
    huge = f"run.min_free_disk_mb={2 ** 40}"
    assert run_cli("run", path, "--run-dir", run_dir, "--set", huge) == 3
    result = summary(run_dir)
    assert result["status"] == "failed" and "free disk space, then `opus resume`" in result["error"]
    (rollback,) = result["rollbacks"]
    assert rollback["kind"] == "disk" and rollback["stage"] == "base"
    assert not (run_dir / "logs").exists()  # no worker was started: nothing computed, nothing lost
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    assert statuses(run_dir) == {"base": "done", "first": "done"}


def test_a_full_disk_is_a_disk_failure_however_a_library_reports_it() -> None:
    import errno

    from opus.pipeline.worker import failure_kind

    class SafetensorError(Exception):  # safetensors' own type keeps only the OS error's text
        pass

    assert failure_kind(SafetensorError("Error while serializing: I/O error: No space left on device "
                                        "(os error 28)")) == "disk"
    assert failure_kind(OSError(errno.ENOSPC, "No space left on device")) == "disk"
    assert failure_kind(SafetensorError("invalid header: truncated")) == "input"  # a damaged file repeats
    assert failure_kind(RuntimeError("CUDA error")) == "crash"
