"""The shared chooser: interleaved rounds, a margin from their spread, ties to the more accurate, then the simpler."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import count

import pytest

from opus.runtime.timed_choice import (
    MIN_MARGIN,
    Option,
    credible,
    decide,
    decide_from,
    faster_every_round,
    interleave,
    noise_margin,
    relative_spread,
    replayed,
    reported,
    write_decisions,
)


def fixed(table: dict[str, list[float]]) -> tuple[list[Option], list[str]]:
    """Options whose runs report the given timings round by round; ``calls`` records the order."""
    calls: list[str] = []
    turns = {name: iter(values) for name, values in table.items()}

    def run_of(name: str) -> Callable[[], float]:
        def run() -> float:
            calls.append(name)
            return next(turns[name])
        return run

    return [Option(name, run_of(name)) for name in table], calls


def test_rounds_are_interleaved_and_the_warm_up_is_not_counted() -> None:
    options, calls = fixed({"a": [9.0, 1.0, 2.0], "b": [9.0, 3.0, 4.0]})
    samples = interleave(options, rounds=2, warmup=1, timer=reported)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert samples == {"a": [1.0, 2.0], "b": [3.0, 4.0]}


def test_the_default_timer_times_each_call() -> None:
    clock = count()
    samples = interleave([Option("a", lambda: next(clock))], rounds=3, warmup=0)
    assert len(samples["a"]) == 3 and all(s >= 0 for s in samples["a"])


def test_clearly_fastest_wins() -> None:
    d = decide("x", [Option("slow", lambda: 10.0), Option("fast", lambda: 5.0, error=1.0)], 5, timer=reported)
    assert d.winner == "fast" and d.tied == ["fast"] and d.margin == MIN_MARGIN
    assert "fastest by more than" in d.reason


def test_a_tie_within_the_margin_goes_to_the_more_accurate() -> None:
    options = [Option("rough", lambda: 100.0, error=0.02), Option("exact", lambda: 101.0, error=0.001)]
    d = decide("x", options, 5, timer=reported)
    assert d.tied == ["rough", "exact"] and d.winner == "exact"
    assert "more accurate" in d.reason and "rough" in d.reason


def test_a_tie_between_equally_accurate_options_goes_to_the_simpler() -> None:
    options = [Option("compiled", lambda: 100.0, simplicity=1), Option("eager", lambda: 101.5, simplicity=0)]
    assert decide("x", options, 5, timer=reported).winner == "eager"


def test_the_margin_is_measured_from_the_rounds() -> None:
    # a's rounds spread by 4% of its median, b's by 8%: the margin is 6%, a's 5% lead is inside it, and
    # the tie goes to the simpler b
    a = Option("a", iter([0, 94.0, 95.0, 95.0, 98.8, 99.0]).__next__, simplicity=1)
    b = Option("b", iter([0, 90.0, 96.0, 100.0, 104.0, 111.0]).__next__)
    d = decide("x", [a, b], 5, timer=reported)
    assert d.margin == pytest.approx(0.06) and d.tied == ["a", "b"] and d.winner == "b"
    # the same rounds without the noise: a is faster beyond the floor and wins
    steady = decide("x", [Option("a", lambda: 95.0, simplicity=1), Option("b", lambda: 100.0)], 5, timer=reported)
    assert steady.margin == MIN_MARGIN and steady.winner == "a"


def test_one_option_caught_in_a_burst_does_not_tie_everything() -> None:
    wild = [0, 70.0, 80.0, 40.0, 55.0, 60.0]
    options = [Option("fast", lambda: 50.0, error=0.1), Option("slow", lambda: 60.0),
               Option("wild", iter(wild).__next__, error=0.2)]
    d = decide("x", options, 5, timer=reported)
    assert d.margin == MIN_MARGIN and d.winner == "fast" and d.tied == ["fast"]


def test_an_outlier_round_does_not_flip_the_decision() -> None:
    steady = {"a": [10.0, 10.1, 9.9, 10.0, 10.0], "b": [12.0, 12.1, 11.9, 12.0, 12.0]}
    spiked = {"a": [10.0, 10.1, 60.0, 10.0, 10.0], "b": [12.0, 12.1, 11.9, 12.0, 12.0]}  # the machine stalled once
    winners = []
    for table in (steady, spiked):
        options, _ = fixed({k: [0.0, *v] for k, v in table.items()})
        d = decide("x", options, 5, timer=reported)
        winners.append((d.winner, d.tied, round(d.medians["a"], 6)))
    assert winners[0] == winners[1] == ("a", ["a"], 10.0)


def test_spread_is_the_interquartile_range_over_the_median() -> None:
    assert relative_spread([1.0]) == 0.0
    assert relative_spread([8.0, 9.0, 10.0, 11.0, 12.0]) == pytest.approx(0.2)
    assert noise_margin({"a": [10.0, 10.0, 10.0]}) == MIN_MARGIN
    assert noise_margin({"a": [10.0, 10.0, 10.0]}, floor=0.0) == 0.0
    assert noise_margin({"a": [8.0, 9.0, 10.0, 11.0, 12.0], "b": [1.0] * 5, "c": [1.0, 9.0, 10.0, 50.0, 90.0]},
                        floor=0.0) == pytest.approx(0.2)  # the median option's spread


def test_credible_times_count_a_lost_tie_as_no_faster_than_its_winner() -> None:
    options = {"fp32": (100.0, 0.0), "w8": (50.0, 0.001), "w4": (49.5, 0.01), "w2": (30.0, 0.1)}
    d = decide("x", [Option(n, lambda t=t: t, error=e) for n, (t, e) in options.items()], 3, timer=reported)
    assert d.winner == "w2"
    counted = credible(d)
    assert counted["w2"] == 30.0 and counted["w8"] == 50.0 and counted["fp32"] == 100.0
    assert 50.0 < counted["w4"] < 50.001  # tied with the more accurate w8: counted a hair slower than it


def test_record_and_file(tmp_path) -> None:  # noqa: ANN001
    class Ctx:  # the one StageContext method write_decisions calls
        def write_artifact(self, name: str, obj: object) -> None:
            (tmp_path / name).write_text(json.dumps(obj))

    d = decide("cache", [Option("a", lambda: 1.0), Option("b", lambda: 2.0)], 3, timer=reported)
    write_decisions(Ctx(), [d, replayed("plan", "plan.yaml", "/runs/old")])
    doc = json.loads((tmp_path / "decisions.json").read_text())
    first, second = doc["decisions"]
    assert first["winner"] == "a" and first["margin"] == MIN_MARGIN and "rule" in doc
    assert [c["rounds"] for c in first["candidates"]] == [[1.0] * 3, [2.0] * 3]
    assert second["replayed_from"] == "old" and second["reason"] == "replayed from old"  # no absolute path


def test_a_replayed_decision_names_its_source_from_the_run_directory_on() -> None:
    from opus.runtime.timed_choice import replayed, run_relative

    assert run_relative("/home/u/runs/k3-1/stages/05-kv_config/artifacts/kv_config.json") == \
        "k3-1/stages/05-kv_config/artifacts/kv_config.json"
    assert run_relative("/home/u/runs/k3-1/artifacts/plan/plan.yaml") == "k3-1/artifacts/plan/plan.yaml"
    assert run_relative("runs/k3-1/artifacts/plan/plan.yaml") == "runs/k3-1/artifacts/plan/plan.yaml"
    record = replayed("plan", "plan.yaml", "/abs/runs/k3-1/artifacts/plan/plan.yaml").record()
    assert "/abs" not in str(record) and record["replayed_from"] == "k3-1/artifacts/plan/plan.yaml"


def test_a_pick_the_noise_handed_to_the_simpler_is_measured_once_more() -> None:
    # A burst in the first five rounds ties a 20 % faster option with a simpler one; calm rounds part them.
    burst_fast, burst_simple = [1.0, 1.5, 0.7, 1.4, 1.0], [1.2, 1.8, 0.9, 1.6, 1.2]
    options, calls = fixed({"fast": [9.0, *burst_fast, *[1.0] * 5], "simple": [9.0, *burst_simple, *[1.2] * 5]})
    options = [Option("fast", options[0].run, simplicity=1), Option("simple", options[1].run, simplicity=0)]
    repeats: list[int] = []
    d = decide("x", options, 5, timer=reported, on_repeat=lambda: repeats.append(len(calls)))
    assert repeats == [2 * (1 + 5)]  # told before the second set of rounds, after the first
    assert len(calls) == 2 * (1 + 5 + 5) and d.winner == "fast"
    assert len(d.samples["fast"]) == 10 and "over 10 rounds: the first 5 had a" in d.reason


def test_a_calm_tie_or_a_fastest_winner_is_not_measured_again() -> None:
    options, calls = fixed({"a": [9.0, *[1.0] * 5, 5.0], "b": [9.0, *[1.01] * 5, 5.0]})
    d = decide("x", [Option("a", options[0].run, simplicity=1), Option("b", options[1].run)], 5, timer=reported)
    assert d.winner == "b" and len(calls) == 12  # a narrow margin: the simpler keeps the tie, once measured
    noisy, calls = fixed({"a": [9.0, 1.0, 1.5, 0.7, 1.4, 1.0], "b": [9.0, 1.2, 1.8, 0.9, 1.6, 1.2]})
    d = decide("x", noisy, 5, timer=reported)  # equally simple: the fastest wins the tie, nothing to repeat
    assert d.winner == "a" and len(calls) == 12


def test_faster_every_round_is_a_paired_comparison_with_the_winner():
    options = [Option("simple", simplicity=0), Option("lossy", simplicity=2, error=0.1), Option("fast", simplicity=1),
               Option("faster", simplicity=1)]
    drift = [1.0, 1.0, 1.5, 1.5, 1.5]  # the machine slowed down after two rounds
    samples = {"simple": drift, "lossy": [t * 0.8 for t in drift], "fast": [t * 0.9 for t in drift],
               "faster": [t * 0.85 for t in drift[:4]] + [1.6]}
    decision = decide_from("which", options, samples)
    assert set(decision.tied) == set(samples) and decision.winner == "simple"  # the margin drift made
    # "faster" lost the last round, "lossy" is less accurate: "fast" beat the winner in every round.
    assert faster_every_round(decision) == ("fast", pytest.approx(0.9))
    samples["faster"] = [t * 0.85 for t in drift]
    assert faster_every_round(decide_from("which", options, samples)) == ("faster", pytest.approx(0.85))
    # Faster in every round by less than MIN_MARGIN, or over fewer than PAIRED_ROUNDS rounds: no.
    close = {"simple": drift, "fast": [t * 0.99 for t in drift]}
    assert faster_every_round(decide_from("which", options[::2], close)) is None
    short = {name: values[:4] for name, values in samples.items()}
    assert faster_every_round(decide_from("which", options, short)) is None
