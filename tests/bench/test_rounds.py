"""``opus bench`` times its contenders in interleaved rounds (opus.bench.rounds), on real tiny models.

The calls are recorded, not faked: ``core.timed_run`` is wrapped to note which contender ran and what
it measured, then runs as usual. No assertion is about speed: only about order, pairing and grouping.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from opus.bench import core, run
from opus.bench.core import Built, Contender, Unavailable
from opus.bench.display import BenchDisplay
from opus.bench.output import to_json, to_markdown
from opus.bench.rounds import plan_groups
from opus.bench.run import BenchRequest, run_bench
from opus.kv.cache import cache_factory
from opus.runtime.noise import paired_key
from opus.runtime.paired import MIN_ROUNDS, rotation
from tests.bench.project import make_project


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("rounds"))


def _copy(ctx: Any) -> Built:
    model = ctx.load("float32")  # the fp32 model once more: a second real contender
    return Built(model, cache_factory(model), ["the fp32 model again"])


def _gone(ctx: Any) -> Built:
    raise Unavailable("needs a kernel this machine lacks")


def _broken(ctx: Any) -> Built:
    raise RuntimeError("the export crashed")


EXTRA = (Contender("copy", "fp32 again", "torch", _copy), Contender("gone", "unavailable here", "torch", _gone),
         Contender("broken", "fails to build", "torch", _broken))


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every timed run as (contender, its figures), in the order they ran."""
    names: dict[int, str] = {}
    calls: list[tuple[str, dict[str, Any]]] = []
    build_once, timed_run = run.build_once, core.timed_run

    def building(contender: Contender, *args: Any) -> Any:
        entry = build_once(contender, *args)
        if entry.built is not None:
            names[id(entry.built)] = contender.name
        return entry

    def timing(built: Built, *args: Any) -> dict[str, Any]:
        figures = timed_run(built, *args)
        calls.append((names[id(built)], figures))
        return figures

    monkeypatch.setattr(run, "build_once", building)
    monkeypatch.setattr(core, "timed_run", timing)
    return calls


def _bench(pipeline: Path, tmp_path: Path, only: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    request = BenchRequest(target=pipeline, runs_dir=tmp_path / "runs", only=only, extra=EXTRA, group_size=32)
    with BenchDisplay(quiet=True) as display:
        report, rows = run_bench(request, display)
    return report, {row.name: row for row in rows}


def test_rounds_rotate_over_every_contender_and_ratios_come_from_paired_rounds(pipeline, tmp_path,
                                                                                 monkeypatch) -> None:
    calls = _recorded(monkeypatch)
    report, rows = _bench(pipeline, tmp_path, ["bf16"])
    # Contenders that cannot run keep their row and say why; they take no part in the rounds.
    assert list(rows) == ["fp32", "bf16", "copy", "gone", "broken"]
    assert rows["gone"].status == "skipped" and rows["gone"].reason == "needs a kernel this machine lacks"
    assert rows["broken"].status == "failed" and "the export crashed" in rows["broken"].reason
    timing = report["timing"]
    assert timing["interleaved"] and timing["grouping"] is None and len(timing["groups"]) == 1
    group = timing["groups"][0]
    names = ["fp32", "bf16", "copy"]
    assert group["contenders"] == names
    rounds = group["rounds"]
    assert rounds in (MIN_ROUNDS, 2 * MIN_ROUNDS)  # the workload asks for 1 repeat: ratios need 5 rounds
    # One warm-up round, then round r runs every contender once, starting at contender r mod 3.
    expected = [names[i] for r in [0, *range(rounds)] for i in rotation(r, 3)]
    assert [name for name, _ in calls] == expected
    assert group["orders"][:3] == [["fp32", "bf16", "copy"], ["bf16", "copy", "fp32"], ["copy", "fp32", "bf16"]]
    timed = calls[3:]  # after the warm-up round
    per_round = [{name: figures for name, figures in timed[3 * r: 3 * r + 3]} for r in range(rounds)]
    for name in ("bf16", "copy"):
        row = rows[name]
        assert row.status == "ok", row.reason
        for key in ("throughput_tok_s", "ttft_ms", "decode_tok_s"):
            paired = row.metrics[paired_key(key)]
            # Each ratio pairs the contender with the baseline of the same round.
            ratios = [r[name][key] / r["fp32"][key] for r in per_round]
            assert paired["ratios"] == [round(x, 5) for x in ratios] and paired["n"] == rounds
            assert paired["ratio"] == pytest.approx(statistics.median(ratios))
            assert paired["low"] <= paired["ratio"] <= paired["high"]
            assert row.ratios[key] == paired["ratio"]  # the table's ratio is the paired one, with its interval
            assert row.intervals[key]["low"] == paired["low"] and row.intervals[key]["n"] == rounds
            assert isinstance(row.intervals[key]["noisy"], bool)
        # A contender's own figure is the median over its rounds; D over every request of every round.
        assert row.metrics["throughput_tok_s"] == pytest.approx(
            statistics.median(r[name]["throughput_tok_s"] for r in per_round))
        assert row.metrics["ttft_ms_spread"]["n"] == rounds * group["ttft_requests_per_round"] >= 9
        # Not timed: measured once, as before (memory after the build, perplexity, agreement).
        assert row.metrics["peak_mem_mb"] > 0 and row.metrics["peak_mem_others_mb"] >= 0
        assert row.metrics["agreement"] == 1.0
        assert paired_key("perplexity") not in row.metrics and "perplexity" not in row.intervals
    assert rows["fp32"].metrics["peak_mem_others_mb"] == 0  # nothing was built before the baseline
    assert rows["copy"].ratios["perplexity"] == pytest.approx(1.0)
    # The table and the JSON say how the figures were taken, with the intervals.
    markdown = to_markdown(report, list(rows.values()))
    assert "- timing: interleaved" in markdown and "round 2: bf16, copy, fp32" in markdown
    assert f"{rows['copy'].ratios['throughput_tok_s']:.2f} [{rows['copy'].intervals['throughput_tok_s']['low']:.2f}–" \
        in markdown
    assert "| gone |" in markdown and "skipped: needs a kernel this machine lacks" in markdown
    assert '"interleaved": true' in to_json(report, list(rows.values()))
    noisy = [f"{n} {k}" for n in ("bf16", "copy") for k, i in rows[n].intervals.items() if i["noisy"]]
    assert timing["noisy"] == noisy


def test_contenders_that_do_not_fit_are_grouped_each_group_with_the_baseline(pipeline, tmp_path,
                                                                               monkeypatch) -> None:
    calls = _recorded(monkeypatch)
    monkeypatch.setattr(run, "available_mb", lambda device: 1.0)  # room for no contender beside the baseline
    report, rows = _bench(pipeline, tmp_path, ["bf16"])
    timing = report["timing"]
    groups = timing["groups"]
    # A group per contender here, each with the baseline in its rounds; the groups of the contenders that
    # could not run have nothing to time.
    assert [g["contenders"] for g in groups] == [["fp32", "bf16"], ["fp32", "copy"]]
    assert "planned in 4 groups that fit" in timing["grouping"]
    sequence = [name for name, _ in calls]
    at = 0
    for group in groups:  # the rounds of one group end before the next group's start: never mixed
        n = len(group["contenders"])
        size = n * (1 + group["rounds"])
        assert sequence[at: at + size] == [group["contenders"][i] for r in [0, *range(group["rounds"])]
                                           for i in rotation(r, n)]
        at += size
    assert at == len(sequence)
    for name in ("bf16", "copy"):
        assert rows[name].status == "ok" and rows[name].intervals["throughput_tok_s"]["n"] >= MIN_ROUNDS
    assert rows["gone"].status == "skipped" and rows["broken"].status == "failed"
    assert any("its figures are group 1's" in note for note in rows["fp32"].notes)
    markdown = to_markdown(report, list(rows.values()))
    assert "- memory: the contenders would hold" in markdown and "group 2: fp32, copy" in markdown


def test_groups_are_planned_from_model_sizes_against_available_memory() -> None:
    def contender(name: str) -> Contender:
        return Contender(name, name, "torch", _copy)

    chosen = [contender(n) for n in ("fp32", "bf16", "w4a16", "hf", "onnx-fp32", "mystery")]
    everything = plan_groups(chosen, fp32_mb=100, available=10_000)
    assert [[c.name for c in g] for g in everything.groups] == [["bf16", "w4a16", "hf", "onnx-fp32", "mystery"]]
    assert not everything.grouped and everything.need_mb == pytest.approx((2 + 1 + 0.5 + 0.25 + 1 + 2 + 1) * 100)
    # 0.8 × 625 = 500 MB: the baseline (100) and a build's headroom (200) leave 200 MB per group.
    tight = plan_groups(chosen, fp32_mb=100, available=625)
    assert [[c.name for c in g] for g in tight.groups] == [["bf16", "w4a16", "hf"], ["onnx-fp32"], ["mystery"]]
    assert tight.grouped
    # 100 MB per group: onnx-fp32's two graphs (200 MB) fit no group, so they get one of their own.
    tighter = plan_groups(chosen, fp32_mb=100, available=500)
    assert [[c.name for c in g] for g in tighter.groups] == [["bf16", "w4a16"], ["hf"], ["onnx-fp32"], ["mystery"]]
    alone = plan_groups(chosen[:1], fp32_mb=100, available=1)  # only the baseline: one group of it alone
    assert alone.groups == [[]] and not alone.grouped
