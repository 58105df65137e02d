"""Honest verdicts: a run's status, exit code and final metrics never claim more than what happened."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import MEASURE, SCALE, events, pipeline, run_cli, statuses, summary, write_pipeline

BASE = {"id": "base", "uses": MEASURE, "with": {"baseline": True, "throughput_tok_s": 100.0}}


def _run(tmp_path: Path, stages: list[dict]) -> tuple[int, Path]:
    path = write_pipeline(tmp_path / "p.yaml", pipeline(stages))
    run_dir = tmp_path / "run"
    return run_cli("run", path, "--run-dir", run_dir), run_dir


def test_every_stage_done_is_finished_with_the_eval_metrics_final(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "q", "uses": SCALE, "needs": ["base"]},
        {"id": "check", "uses": MEASURE, "needs": ["base", "q"],
         "with": {"role": "eval", "throughput_tok_s": 150.0, "perplexity": 10.1},
         "gate": {"perplexity": {"max_increase": 0.02}}},
        {"id": "measured_later", "uses": MEASURE, "needs": ["check"], "with": {"throughput_tok_s": 999.0}}])
    result = summary(run_dir)
    assert code == 0 and result["status"] == "finished" and result["reasons"] == []
    assert result["final_stage"] == "check" and result["ratios"]["throughput_tok_s"] == 1.5
    assert list(result)[0] == "status"


def test_what_a_stage_did_not_do_is_a_warning_of_the_run_not_a_failure(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "q", "uses": SCALE, "needs": ["base"]},
        {"id": "check", "uses": MEASURE, "needs": ["base", "q"], "with": {"role": "eval"}},
        {"id": "out", "uses": MEASURE, "needs": ["check"], "with": {"role": "export", "warn": "ONNX not exported"}}])
    result = summary(run_dir)
    assert code == 0 and result["status"] == "finished"
    assert result["warnings"] == ["out: ONNX not exported"]
    assert next(s for s in result["stages"] if s["id"] == "out")["warnings"] == ["ONNX not exported"]
    assert run_cli("run", tmp_path / "p.yaml", "--run-dir", run_dir) == 0  # cached: the warning stays
    assert summary(run_dir)["warnings"] == ["out: ONNX not exported"]


def test_failed_baseline_ends_the_run_whatever_on_fail_says(tmp_path: Path) -> None:
    base = {**BASE, "gate": {"throughput": {"min": 1000}}, "on_fail": "skip"}
    code, run_dir = _run(tmp_path, [base, {"id": "q", "uses": SCALE, "needs": ["base"]}])
    result = summary(run_dir)
    assert code == 3 and result["status"] == "failed" and "baseline cannot be skipped" in result["error"]
    assert statuses(run_dir) == {"base": "failed", "q": "skipped"}
    assert result["reasons"][-1] == "not run, the run ended before them: q"
    assert result["final_stage"] is None and result["ratios"] == {}


def test_nothing_transformed_is_failed(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [BASE, {"id": "q", "uses": SCALE, "needs": ["base"], "with": {"crash": True}},
                                    {"id": "f", "uses": SCALE, "needs": ["q"], "with": {"crash": True}}])
    result = summary(run_dir)
    assert code == 3 and result["status"] == "failed"
    assert result["reasons"][0].startswith("no model-transforming stage survived")
    assert "stage 'q' rolled back" in " ".join(result["reasons"])


def test_a_skipped_stage_beside_a_surviving_transform_is_degraded(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "q", "uses": SCALE, "needs": ["base"]},
        {"id": "f", "uses": SCALE, "needs": ["q"], "with": {"crash": True}},
        {"id": "check", "uses": MEASURE, "needs": ["base", "f"], "with": {"role": "eval"},
         "gate": {"perplexity": {"max_increase": 0.02}}}])
    result = summary(run_dir)
    assert code == 4 and result["status"] == "degraded" and result["final_stage"] == "check"
    (reason,) = result["reasons"]
    assert reason.startswith("stage 'f' rolled back: RuntimeError: the stage crashed on purpose (log: ")


def test_a_failed_eval_is_failed_and_claims_no_final_metrics(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "q", "uses": SCALE, "needs": ["base"]},
        {"id": "check", "uses": MEASURE, "needs": ["base", "q"], "with": {"role": "eval", "perplexity": 20.0},
         "gate": {"perplexity": {"max_increase": 0.02}}, "on_fail": "skip"}])
    result = summary(run_dir)
    assert code == 3 and result["status"] == "failed" and result["final_stage"] is None
    assert result["final"] == {} and result["ratios"] == {}


def test_nan_weights_are_never_restored_nor_final(tmp_path: Path) -> None:
    """A stage turns the weights NaN; the eval after it fails and rolls back past it to a verified model."""
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "nanify", "uses": SCALE, "needs": ["base"], "with": {"factor": float("nan")}, "on_fail": "skip"},
        {"id": "check", "uses": MEASURE, "needs": ["base", "nanify"], "with": {"role": "eval", "from_model": True},
         "gate": {"throughput": {"min_ratio": 0.5}}, "on_fail": "skip"}])
    result = summary(run_dir)
    assert code == 3 and result["status"] == "failed" and result["final_stage"] is None
    (rollback,) = result["rollbacks"]
    # The gate only named throughput, yet a NaN perplexity fails it; the restored model is the baseline's.
    assert rollback["bound"] == "finite" and rollback["metric"] == "perplexity"
    assert rollback["restored"] == "00-base"
    state = json.loads((run_dir / "stages" / "02-check" / "state.json").read_text())
    assert state["tensors"] is None and state["recipe"] == []


def test_a_non_finite_accuracy_fails_an_ungated_stage(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "nanify", "uses": SCALE, "needs": ["base"], "with": {"factor": float("nan")}},
        {"id": "look", "uses": MEASURE, "needs": ["nanify"], "with": {"from_model": True}}])
    assert statuses(run_dir)["look"] == "rolled_back"
    assert summary(run_dir)["rollbacks"][0]["reason"].startswith("perplexity is nan (not finite)")


def test_retry_that_runs_out_aborts(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "q", "uses": SCALE, "needs": ["base"], "with": {"quality": 0.0},
               "gate": {"quality": {"min": 0.9}}, "on_fail": "retry", "retries": 1},
        {"id": "after", "uses": SCALE, "needs": ["q"]}])
    result = summary(run_dir)
    assert code == 3 and result["status"] == "failed" and "retries are used up" in result["error"]
    assert [r["action"] for r in result["rollbacks"]] == ["retry", "abort"]
    assert statuses(run_dir) == {"base": "done", "q": "failed", "after": "skipped"}


def test_bad_input_is_not_retried(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "q", "uses": SCALE, "needs": ["base"], "with": {"bad_input": True}, "on_fail": "retry",
               "retries": 4}])
    assert code == 3
    started = [e for e in events(run_dir) if e["event"] == "stage_started" and e["stage"] == "q"]
    assert len(started) == 1
    (rollback,) = summary(run_dir)["rollbacks"]
    assert rollback["kind"] == "input" and "not retried" in summary(run_dir)["error"]


def test_slower_final_model_is_a_warning(tmp_path: Path) -> None:
    code, run_dir = _run(tmp_path, [
        BASE, {"id": "q", "uses": SCALE, "needs": ["base"]},
        {"id": "check", "uses": MEASURE, "needs": ["base", "q"], "with": {"role": "eval", "throughput_tok_s": 50.0}}])
    result = summary(run_dir)
    assert code == 0 and result["status"] == "finished"
    (warning,) = result["warnings"]
    assert "slower than the baseline" in warning and "throughput_tok_s" in warning


def test_cli_prints_status_reasons_first(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    code, run_dir = _run(tmp_path, [BASE, {"id": "q", "uses": SCALE, "needs": ["base"], "with": {"crash": True}}])
    out = capsys.readouterr().out.splitlines()
    assert code == 3 and out[0].startswith("failed: ") and out[1].startswith("  why       no model-transforming")
