"""``opus compare``: flattened metrics, old / new / Δ / Δ%, changed parameters, per-side errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from opus.cli.main import main
from opus.report.compare import compare_runs, diff_metrics, flatten, pipeline_params, sense, summary_metrics
from opus.report.history import commit_run, resolve_run
from tests.fabricate import fake_run, git, make_repo


def test_flatten_and_deltas() -> None:
    assert flatten({"a": {"b": 1, "c": [2, {"d": 3}]}}) == {"a.b": 1, "a.c.0": 2, "a.c.1.d": 3}
    rows = {r.key: r for r in diff_metrics({"x": 100.0, "s": "ok", "gone": 1}, {"x": 150.0, "s": "no", "new": 2})}
    assert rows["x"].delta == 50.0 and rows["x"].delta_pct == 50.0
    assert rows["s"].delta is None and rows["s"].changed
    assert rows["gone"].new is None and rows["new"].old is None
    assert diff_metrics({"z": 0.0}, {"z": 1.0})[0].delta_pct is None  # no percentage of zero


def test_summary_and_pipeline_keys(tmp_path: Path) -> None:
    run = resolve_run(str(fake_run(tmp_path / "r1", factor=3.0)))
    keys = summary_metrics(run.summary)
    assert keys["baseline.throughput_tok_s"] == 100.0 and keys["final.ttft_ms"] == 80.0
    assert keys["ratios.perplexity"] == pytest.approx(1.02) and keys["stages.quant.metrics.quantized_layers"] == 4
    params = pipeline_params(run.pipeline)
    assert params["stages.quant.with.factor"] == 3.0 and params["stages.eval.needs.0"] == "quant"


@pytest.fixture
def history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two commits, each with one run: r1 (P 150, factor 1) then r2 (P 210, factor 2)."""
    repo = make_repo(tmp_path / "repo")
    commit_run(fake_run(repo / "runs" / "r1", throughput=150.0, factor=1.0))
    commit_run(fake_run(repo / "runs" / "r2", throughput=210.0, ttft=60.0, factor=2.0, rollback=True))
    monkeypatch.chdir(repo)
    return repo


def test_compare_two_commits(history: Path) -> None:
    cmp = compare_runs(resolve_run("HEAD~1"), resolve_run("HEAD"))
    assert cmp.ok and cmp.a.path == "runs/r1" and cmp.b.path == "runs/r2"
    rows = {r.key: r for r in cmp.metrics}
    p = rows["final.throughput_tok_s"]
    assert (p.old, p.new, p.delta, p.delta_pct) == (150.0, 210.0, 60.0, 40.0)
    assert rows["ratios.ttft_ms"].old == 0.8 and rows["ratios.ttft_ms"].new == 0.6
    assert rows["rollbacks"].delta == 1
    assert not rows["baseline.throughput_tok_s"].changed
    assert [(r.key, r.old, r.new) for r in cmp.params] == [("stages.quant.with.factor", 1.0, 2.0)]


def test_compare_cli_markdown_and_json(history: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", "HEAD~1", "HEAD", "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "| final.throughput_tok_s | 150 | 210 | +60 | +40.00% | better |" in out
    assert "| final.ttft_ms | 80 | 60 | -20 | -25.00% | better |" in out  # lower is better
    assert "| stages.quant.with.factor | 1 | 2 |" in out
    assert "baseline.throughput_tok_s" not in out  # unchanged keys only with --all
    assert main(["compare", "HEAD~1", "HEAD:runs/r2", "--format", "json", "--all"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["a"]["where"].endswith(":runs/r1") and data["b"]["where"].endswith(":runs/r2")
    keys = {m["key"]: m for m in data["metrics"]}
    assert keys["baseline.throughput_tok_s"]["delta"] == 0 and keys["final.ttft_ms"]["delta_pct"] == -25.0
    assert data["params"] == [{"key": "stages.quant.with.factor", "old": 1.0, "new": 2.0}]


def test_compare_a_commit_with_a_run_directory(history: Path, capsys: pytest.CaptureFixture) -> None:
    fake_run(history / "runs" / "r3", throughput=300.0)  # on disk only, not committed
    assert main(["compare", "HEAD", "runs/r3", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["b"]["where"] == "runs/r3"
    assert {m["key"]: m["new"] for m in data["metrics"]}["final.throughput_tok_s"] == 300.0


def test_a_committed_run_path_no_longer_on_disk(history: Path) -> None:
    shutil.rmtree(history / "runs" / "r1")
    run = resolve_run("runs/r1")  # read from HEAD's tree
    assert run.error is None and run.commit == git(history, "rev-parse", "HEAD").strip()
    assert run.summary["final"]["throughput_tok_s"] == 150.0


@pytest.mark.parametrize("argv", [["no-such-rev", "HEAD"], ["HEAD", "no-such-rev"],
                                  ["HEAD:runs/missing", "HEAD"], ["no-such-rev", "other-bad"]])
@pytest.mark.parametrize("form", ["md", "json", "table"])
def test_a_bad_side_is_one_line_on_stderr_and_nothing_on_stdout(history: Path, capsys: pytest.CaptureFixture,
                                                                   argv: list[str], form: str) -> None:
    assert main(["compare", *argv, "--format", form]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith("error: ")
    bad = [label for label in argv if label != "HEAD"]
    assert all(label in captured.err for label in bad)


def test_a_bad_revision_is_named_and_the_api_still_shows_the_good_side(history: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", "no-such-rev"]) == 2
    assert "'no-such-rev' is neither a run directory nor a known git revision" in capsys.readouterr().err
    cmp = compare_runs(resolve_run("HEAD:runs/missing"), resolve_run("HEAD"))
    assert not cmp.ok and "no runs/missing/summary.json" in cmp.a.error
    assert {r.key: r.new for r in cmp.metrics}["final.throughput_tok_s"] == 210.0


def test_compare_outside_a_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    fake_run(tmp_path / "r1")
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "r1", "HEAD", "--format", "md"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "not inside a git repository" in captured.err


def test_which_way_is_better() -> None:
    higher = ("final.throughput_tok_s", "stages.eval.metrics.decode_tok_s", "stages.x.metrics.decode_tok_s_batch",
              "final.agreement", "final.logits_cosine", "final.top5_overlap", "final.top1_accuracy",
              "ratios.throughput_tok_s", "stages.kv.metrics.kv_speedup_vs_growing")
    lower = ("final.ttft_ms", "stages.eval.metrics.prefill_ms_batch", "final.perplexity", "ratios.perplexity",
             "final.peak_mem_mb", "stages.eval.metrics.model_mb", "stages.fuse.metrics.decode_ms_after")
    assert all(sense(k) == 1 for k in higher) and all(sense(k) == -1 for k in lower)
    assert sense("rollbacks") == sense("stages.quant.metrics.quantized_layers") == sense("status") == 0


def test_direction_per_metric(history: Path) -> None:
    fake_run(history / "runs" / "r3", throughput=120.0, ttft=60.0, perplexity=10.5)  # r2: P 210, D 60, ppl 10.2
    fake_run(history / "runs" / "r4", throughput=120.0, ttft=60.0, perplexity=10.5, name="other")
    rows = {r.key: r.direction for r in compare_runs(resolve_run("HEAD"), resolve_run("runs/r3")).metrics}
    assert rows["final.throughput_tok_s"] == "worse" and rows["final.perplexity"] == "worse"
    assert rows["final.ttft_ms"] == rows["baseline.throughput_tok_s"] == "unchanged"
    assert rows["rollbacks"] == "changed"  # a count with no good direction
    assert rows["ratios.perplexity"] == "worse" and rows["ratios.throughput_tok_s"] == "worse"
    rows = {r.key: r.direction for r in compare_runs(resolve_run("runs/r3"), resolve_run("HEAD")).metrics}
    assert rows["final.throughput_tok_s"] == "better" and rows["final.perplexity"] == "better"


def test_overlapping_ranges_are_within_noise(tmp_path: Path) -> None:
    old = resolve_run(str(fake_run(tmp_path / "old", throughput=150.0, ttft=80.0, spread=10.0)))
    close = resolve_run(str(fake_run(tmp_path / "close", throughput=158.0, ttft=55.0, spread=10.0)))
    cmp = compare_runs(old, close)
    rows = {r.key: r for r in cmp.metrics}
    p = rows["final.throughput_tok_s"]  # 140..160 and 148..168 overlap
    assert p.direction == "within noise" and p.old_range == (140.0, 160.0) and p.new_range == (148.0, 168.0)
    assert rows["stages.eval.metrics.throughput_tok_s"].direction == "within noise"
    assert rows["final.ttft_ms"].direction == "better"  # 45..65 ms all below 70..90 ms
    assert not any("_spread" in key for key in rows)  # the spreads are ranges of their rows, not rows
    far = resolve_run(str(fake_run(tmp_path / "far", throughput=175.0, ttft=80.0, spread=10.0)))
    rows = {r.key: r for r in compare_runs(old, far).metrics}
    assert rows["final.throughput_tok_s"].direction == "better"  # 140..160 below 165..185
    plain = resolve_run(str(fake_run(tmp_path / "plain", throughput=158.0)))  # a run from before spreads
    rows = {r.key: r for r in compare_runs(old, plain).metrics}
    assert rows["final.throughput_tok_s"].direction == "better" and rows["final.throughput_tok_s"].new_range is None


def test_only_globs_pick_keys(history: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", "HEAD~1", "HEAD", "--format", "json", "--all", "--only", "final.*",
                 "--only", "*.ttft_ms"]) == 0
    keys = {m["key"] for m in json.loads(capsys.readouterr().out)["metrics"]}
    assert "final.throughput_tok_s" in keys and "ratios.ttft_ms" in keys and "baseline.ttft_ms" in keys
    assert all(k.startswith("final.") or k.endswith(".ttft_ms") for k in keys)
    assert main(["compare", "HEAD~1", "HEAD", "--format", "md", "--only", "nothing.*"]) == 0
    assert "no metric differs" in capsys.readouterr().out


def test_rich_table_output(history: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", "HEAD~1", "HEAD", "--format", "table"]) == 0
    out = capsys.readouterr().out
    assert "final.throughput_tok_s" in out and "+40.00%" in out and "stages.quant.with.factor" in out
    assert "better" in out
