"""The ``quantize`` stage through the runner: what it does without a plan to apply."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import events, pipeline, run_cli, statuses, summary, write_pipeline


def test_quantize_without_a_plan_is_an_input_error_not_retried(tmp_path: Path) -> None:
    """No plan.yaml upstream (no plan stage, or one rolled back) repeats on every attempt: one attempt,
    the run stops saying why, and no retry is spent on it."""
    spec = pipeline([{"id": "q", "uses": "quantize", "on_fail": "retry", "retries": 3}],
                    model={"factory": "tests.stages.test_profile:tiny_moe"})
    run_dir = tmp_path / "run"
    code = run_cli("run", write_pipeline(tmp_path / "p.yaml", spec), "--run-dir", run_dir)
    assert code == 3 and statuses(run_dir) == {"q": "failed"}
    assert len([e for e in events(run_dir) if e["event"] == "stage_started"]) == 1
    (rollback,) = summary(run_dir)["rollbacks"]
    assert rollback["kind"] == "input" and "no plan.yaml among its inputs" in rollback["reason"]
    assert "not retried" in summary(run_dir)["error"]
