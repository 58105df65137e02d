"""Side-by-side timing (opus.runtime.paired): paired rounds, alternating order, interval, one repeat when noisy."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from opus.kv.cache import cache_factory
from opus.pipeline.gates import check_gate
from opus.pipeline.spec import Threshold
from opus.pipeline.summary import build_summary
from opus.runtime import paired
from opus.runtime.noise import paired_key
from tests.quant.tiny import tiny_decoder


def test_real_models_give_a_ratio_inside_its_interval() -> None:
    base, cand = tiny_decoder("llama", seed=0), tiny_decoder("llama", seed=1)
    prompts = torch.randint(0, 96, (2, 8))
    out = paired.measure_paired((base, cache_factory(base)), (cand, cache_factory(cand)), prompts, 3,
                                ["throughput_tok_s", "ttft_ms"], rounds=3)
    assert set(out) == {paired_key("throughput_tok_s"), paired_key("ttft_ms")}
    for result in out.values():
        assert result["n"] >= paired.MIN_ROUNDS  # never fewer than 5 pairs, whatever was asked
        assert result["low"] <= result["ratio"] <= result["high"]
        assert all(math.isfinite(r) and r > 0 for r in result["ratios"])
        assert result["baseline"] > 0 and result["candidate"] > 0


def _scripted(monkeypatch: pytest.MonkeyPatch, values: dict[str, list[float]]) -> list[str]:
    """Replace the timed measure by one that returns scripted figures and records who ran when."""
    calls: list[str] = []

    def measure(model: Any, *_: Any) -> float:
        calls.append(model)
        return values[model].pop(0)

    monkeypatch.setitem(paired.MEASURES, "throughput_tok_s", measure)
    return calls


def test_rounds_alternate_and_a_wide_interval_is_measured_again_then_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    # warm-up each, then 5 rounds: ratios 2, 2, 1, 2, 2 -> too wide; 5 more rounds, still wide -> noisy
    base = [1.0] * 11
    cand = [9.0] + [2.0, 2.0, 1.0, 2.0, 2.0] * 2
    calls = _scripted(monkeypatch, {"B": base, "C": cand})
    out = paired.measure_paired(("B", None), ("C", None), torch.zeros(1, 1), 1, ["throughput_tok_s"], rounds=5)
    result = out[paired_key("throughput_tok_s")]
    assert calls[:2] == ["B", "C"] and calls[2:6] == ["B", "C", "C", "B"]  # warm-ups, then alternating
    assert result["n"] == 10 and result["repeated"] and result["noisy"]
    assert (result["ratio"], result["low"], result["high"]) == (2.0, 1.0, 2.0)


def test_a_tight_interval_is_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, {"B": [1.0] * 6, "C": [5.0, 2.0, 2.1, 1.95, 2.05, 2.0]})
    result = paired.measure_paired(("B", None), ("C", None), torch.zeros(1, 1), 1, ["throughput_tok_s"],
                                   rounds=5)[paired_key("throughput_tok_s")]
    assert result["n"] == 5 and not result["noisy"] and "repeated" not in result


def _paired(ratio: float, low: float, high: float) -> dict[str, Any]:
    return {"ratio": ratio, "low": low, "high": high, "n": 5, "noisy": False, "baseline": 100.0, "candidate": 150.0}


def test_gates_on_ratios_use_the_conservative_end() -> None:
    metrics = {"throughput_tok_s": 150.0, paired_key("throughput_tok_s"): _paired(1.5, 1.05, 1.6),
               "ttft_ms": 8.0, paired_key("ttft_ms"): _paired(0.8, 0.7, 0.95)}
    baseline = {"throughput_tok_s": 50.0, "ttft_ms": 20.0}  # far away in time: not what decides
    verdict = check_gate({"throughput": Threshold(min_ratio=1.1), "ttft": Threshold(max_ratio=0.9)}, metrics, baseline)
    p, d = verdict.checks
    assert not p.passed and p.compared == 1.05 and p.interval == (1.05, 1.6) and p.baseline == 100.0
    assert "side-by-side ratio 1.05–1.6" in p.reason
    assert not d.passed and d.compared == 0.95
    gate = {"throughput": Threshold(min_ratio=1.04), "ttft": Threshold(max_ratio=0.96)}
    verdict = check_gate(gate, metrics, baseline)
    assert verdict.passed


def test_the_summary_reports_the_side_by_side_ratio_and_warns_only_on_a_whole_interval_below_one() -> None:
    records = [
        {"id": "baseline", "uses": "baseline", "status": "done", "role": "baseline", "baseline": True,
         "metrics": {"throughput_tok_s": 50.0, "ttft_ms": 20.0}, "gate": None},
        {"id": "eval", "uses": "eval", "status": "done", "role": "eval", "baseline": False,
         "metrics": {"throughput_tok_s": 150.0, paired_key("throughput_tok_s"): _paired(0.97, 0.9, 0.99),
                     "ttft_ms": 8.0, paired_key("ttft_ms"): _paired(0.8, 0.7, 1.02)},
         "gate": {"passed": True, "checks": [{"metric": "perplexity", "passed": True}]}},
    ]
    summary = build_summary("r", "finished", records, [])
    assert summary["ratios"]["throughput_tok_s"] == 0.97 and summary["ratios"]["ttft_ms"] == 0.8
    assert summary["ratio_intervals"]["throughput_tok_s"] == {"low": 0.9, "high": 0.99, "n": 5, "noisy": False}
    assert len(summary["warnings"]) == 1 and "throughput_tok_s ×0.900–0.990" in summary["warnings"][0]


def test_n_sides_rotate_so_no_side_is_always_first_or_last() -> None:
    assert [paired.rotation(r, 3) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert [paired.rotation(r, 2) for r in range(2)] == [[0, 1], [1, 0]]  # two sides: B C, C B as before
    calls: list[int] = []
    speed = {0: 10.0, 1: 20.0, 2: 5.0}

    def run(side: int) -> dict[str, float]:
        calls.append(side)
        return {"p": speed[side] * (1 + 0.01 * len(calls))}  # a slowly drifting machine

    table, out = paired.measure_interleaved(run, 3, ["p", "missing"], rounds=2)
    assert len(table) == paired.MIN_ROUNDS and calls[:9] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    one, two = out["p"]
    assert one["n"] == two["n"] == 5 and not one["noisy"] and "repeated" not in one
    assert one["low"] <= one["ratio"] <= one["high"] and 1.9 < one["ratio"] < 2.1
    assert 0.45 < two["ratio"] < 0.55
    assert out["missing"] == [None, None]  # nothing measured under that key: no ratio, no crash


def test_n_sides_repeat_all_rounds_when_one_ratio_is_wide() -> None:
    calls: list[int] = []
    figures = {0: [1.0] * 10, 1: [1.0] * 10, 2: [2.0, 1.0] * 5}  # side 2 swings between rounds

    def run(side: int) -> dict[str, float]:
        calls.append(side)
        return {"p": figures[side].pop(0)}

    table, out = paired.measure_interleaved(run, 3, ["p"], rounds=5)
    assert len(table) == 10 and len(calls) == 30  # every side measured again, not only the noisy one
    steady, swinging = out["p"]
    assert steady["repeated"] and not steady["noisy"] and steady["n"] == 10
    assert swinging["repeated"] and swinging["noisy"]


def _loaders(calls: list[str]) -> tuple[Any, Any]:
    def load(name: str) -> Any:
        def loader() -> tuple[str, None]:
            calls.append(f"load {name}")
            return name, None
        return loader
    return load("B"), load("C")


def test_bracketed_loads_one_model_at_a_time_baseline_candidate_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _scripted(monkeypatch, {"B": [1.0] * 6 + [1.05] * 6, "C": [2.0] * 6})
    load_b, load_c = _loaders(calls)
    result = paired.measure_bracketed(load_b, load_c, torch.zeros(1, 1), 1, ["throughput_tok_s"],
                                      repeats=5)[paired_key("throughput_tok_s")]
    assert calls == ["load B", *["B"] * 6, "load C", *["C"] * 6, "load B", *["B"] * 6]  # warm-up + 5 each
    assert result["method"] == "bracketed" and result["drift"] == pytest.approx(0.05)
    assert (result["low"], result["high"]) == (pytest.approx(2 / 1.05), 2.0)
    assert result["ratio"] == pytest.approx((2 + 2 / 1.05) / 2) and not result["noisy"] and "repeated" not in result


def test_bracketed_drift_beyond_the_limit_brackets_again_then_marks_noisy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _scripted(monkeypatch, {"B": ([1.0] * 6 + [1.3] * 6) * 2, "C": [2.0] * 12})
    load_b, load_c = _loaders(calls)
    result = paired.measure_bracketed(load_b, load_c, torch.zeros(1, 1), 1, ["throughput_tok_s"],
                                      repeats=5)[paired_key("throughput_tok_s")]
    assert calls.count("load B") == 4 and calls.count("load C") == 2
    assert result["repeated"] and result["noisy"] and result["drift"] == pytest.approx(0.3)


def test_a_bracketed_ratio_says_so_in_the_summary_and_the_report() -> None:
    from opus.runtime.noise import how_measured

    bracketed = {**_paired(1.5, 1.45, 1.55), "n": 2, "method": "bracketed", "drift": -0.06}
    records = [
        {"id": "baseline", "uses": "baseline", "status": "done", "role": "baseline", "baseline": True,
         "metrics": {"throughput_tok_s": 50.0}, "gate": None},
        {"id": "eval", "uses": "eval", "status": "done", "role": "eval", "baseline": False,
         "metrics": {"throughput_tok_s": 75.0, paired_key("throughput_tok_s"): bracketed},
         "gate": {"passed": True, "checks": [{"metric": "perplexity", "passed": True}]}},
    ]
    interval = build_summary("r", "finished", records, [])["ratio_intervals"]["throughput_tok_s"]
    assert interval["method"] == "bracketed" and interval["drift"] == -0.06
    assert how_measured(interval) == "bracketed, baseline drift -6.0%"
    assert how_measured(_paired(1.0, 0.9, 1.1)) == "side by side, 5 rounds"
