"""The drop of a task's accuracy and its interval; gates that pass, fail, or say they cannot tell."""

from __future__ import annotations

import pytest

from opus.harness.compare import compare_scores, paired_drop, wilson
from opus.pipeline.gates import check_gate, task_accuracy_keys
from opus.pipeline.spec import Threshold
from opus.pipeline.summary import build_summary


def test_wilson_interval_of_none_and_all() -> None:
    low, high = wilson(0, 100)
    assert low == 0.0 and high == pytest.approx(0.037, abs=0.001)  # the "rule of three", a little tighter
    low, high = wilson(100, 100)
    assert high == 1.0 and low == pytest.approx(0.963, abs=0.001)


def test_identical_answers_still_leave_an_interval_set_by_the_sample_count() -> None:
    same = [1.0] * 60 + [0.0] * 40
    drop = paired_drop(same, same)
    assert drop["drop"] == 0.0 and drop["worse"] == drop["better"] == 0
    assert drop["low"] == pytest.approx(-drop["high"]) and 0.03 < drop["high"] < 0.04
    wider = paired_drop(same[:20], same[:20])
    assert wider["high"] > 0.1  # 20 samples cannot rule out a 10-point drop


def test_a_real_drop_has_an_interval_that_excludes_zero() -> None:
    base = [1.0] * 60 + [0.0] * 40
    worse = [0.0] * 15 + [1.0] * 45 + [0.0] * 40  # 15 the baseline got, the candidate did not
    drop = paired_drop(base, worse)
    assert drop["drop"] == pytest.approx(0.15) and drop["low"] > 0.05 and drop["high"] < 0.25


def test_compare_scores_reports_each_metric_its_baseline_and_the_drop_of_0_1_metrics() -> None:
    base = {"t": {"acc": [1.0, 1.0, 0.0, 1.0], "bleu": [0.3, 0.5, 0.1, 0.2]}}
    cand = {"t": {"acc": [1.0, 0.0, 0.0, 1.0], "bleu": [0.3, 0.4, 0.1, 0.2]}}
    metrics = compare_scores(base, cand)
    assert metrics["task/t/acc"] == 0.5 and metrics["task/t/acc_base"] == 0.75
    assert metrics["task/t/acc_drop"]["drop"] == 0.25 and metrics["task/t/acc_drop"]["n"] == 4
    assert metrics["task/t/bleu"] == pytest.approx(0.25) and "task/t/bleu_drop" not in metrics  # not 0/1


def _metrics(base: list[float], cand: list[float], task: str = "t") -> dict:
    return compare_scores({task: {"acc": base}}, {task: {"acc": cand}})


def test_max_drop_passes_only_when_the_whole_interval_is_within() -> None:
    gate = {"task_accuracy": Threshold(max_drop=0.05)}
    same = [1.0] * 300 + [0.0] * 200
    verdict = check_gate(gate, _metrics(same, same), None)
    check = verdict.checks[0]
    assert verdict.passed and not check.inconclusive and check.metric == "task/t/acc"
    assert check.interval[1] <= 0.05 and check.baseline == 0.6


def test_max_drop_fails_when_the_whole_interval_is_beyond() -> None:
    base = [1.0] * 60 + [0.0] * 40
    cand = [0.0] * 30 + [1.0] * 30 + [0.0] * 40
    verdict = check_gate({"task_accuracy": Threshold(max_drop=0.05)}, _metrics(base, cand), None)
    assert not verdict.passed and "dropped +0.300" in verdict.checks[0].reason


def test_a_drop_the_samples_cannot_decide_is_inconclusive_kept_and_warned() -> None:
    base = [1.0] * 30 + [0.0] * 20
    cand = [0.0] * 2 + [1.0] * 28 + [0.0] * 20  # 2 of 50 lost: 0.04, interval about -0.03 to +0.13
    verdict = check_gate({"task_accuracy": Threshold(max_drop=0.05)}, _metrics(base, cand), None)
    check = verdict.checks[0]
    assert verdict.passed and check.inconclusive and "inconclusive" in check.reason
    assert check.interval[0] <= 0.05 < check.interval[1]
    record = {"id": "eval", "status": "done", "role": "eval", "metrics": _metrics(base, cand),
              "gate": verdict.as_json()}
    summary = build_summary("r", "finished", [record], [])
    assert any("inconclusive" in w for w in summary["warnings"])
    assert summary["final"]["task/t/acc"] == pytest.approx(0.56)


def test_task_accuracy_names_each_task_and_nothing_is_a_failed_check() -> None:
    metrics = {**_metrics([1.0], [1.0], "a"), "task/b/exact_match": 0.5, "task/b/exact_match_base": 0.5,
               "task/c/acc": 0.2, "task/c/acc_norm": 0.3}
    assert task_accuracy_keys(metrics) == ["task/a/acc", "task/b/exact_match", "task/c/acc"]
    verdict = check_gate({"task_accuracy": Threshold(max_drop=0.1)}, {"perplexity": 3.0}, None)
    assert not verdict.passed and "no task accuracy" in verdict.checks[0].reason
    # Without the paired samples, the drop is the plain difference from the baseline.
    verdict = check_gate({"task/b/exact_match": Threshold(max_drop=0.0)}, metrics, None)
    assert verdict.passed and verdict.checks[0].compared == 0.0
