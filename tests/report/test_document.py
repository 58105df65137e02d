"""Run reports: report.md (+ PNGs) and a self-contained report.html, written at the end of every run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from opus.cli.main import main
from opus.pipeline.events import EventLog
from opus.report.document import timeline_data
from tests.fabricate import fake_run
from tests.helpers import MEASURE, pipeline, run_cli, summary, write_pipeline

PLAN = {"version": 1, "predicted": {"ppl_increase": 0.004},
        "sensitivity": {"method": "suffix", "top_k": 64, "units": 40, "measured": 25, "reused": 15},
        "groups": [{"name": "model.layers.0.mlp", "role": "mlp", "format": "w8a8", "score": {"w8a8": 0.002,
                    "w4a16": 0.03}, "reason": "fastest within the ppl budget"},
                   {"name": "model.layers.0.self_attn", "role": "attention", "format": "float",
                    "score": {"w8a8": 0.09}, "reason": "too sensitive: Δce 0.09"}]}
PROFILE = {"groups": {"experts": {"share": 0.6, "prefill_ms": 3.0}, "attention": {"share": 0.3},
                      "norm": {"share": 0.1}},
           "modules": [{"name": "model.layers.0.mlp.experts.0", "role": "experts", "share": 0.2},
                       {"name": "model.layers.0.self_attn", "role": "attention", "share": 0.15}]}
FUSION = {"counts": {"rmsnorm": 4, "swiglu": 2}, "ignored": [{"name": "lm_head", "reason": "not traceable"}]}
DECISIONS = {"version": 1, "decisions": [
    {"what": "end-to-end check", "unit": "ms", "margin": 0.03, "tied": ["uniform w8a8", "plan"], "winner": "plan",
     "reason": "within the 3.0% noise margin of the fastest (uniform w8a8) and more accurate",
     "candidates": [{"name": "plan", "median": 120.0, "rounds": [120.0, 119.0, 121.0], "error": 0.001},
                    {"name": "uniform w8a8", "median": 118.0, "rounds": [118.0, 117.0, 122.0], "error": 0.004}]}]}
PLOTS = ("waterfall", "precision", "hotspots", "fusion", "timeline")


def _full_run(tmp_path: Path) -> Path:
    return fake_run(tmp_path / "r1", rollback=True, artifacts={
        "quant": {"plan.yaml": yaml.safe_dump(PLAN), "fusion.json": FUSION, "decisions.json": DECISIONS},
        "base": {"profile.json": PROFILE}})


def test_report_has_every_section_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = _full_run(tmp_path)
    assert main(["report", str(run_dir)]) == 0
    assert "report.html" in capsys.readouterr().out
    md = (run_dir / "report.md").read_text()
    for name in PLOTS:
        assert f"(report/{name}.png)" in md
        assert (run_dir / "report" / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    assert "| P, tokens/s | 100 | 150 | ×1.500 |" in md
    assert "| model.layers.0.self_attn | float | 0.09 | w8a8 0.09 | too sensitive: Δce 0.09 |" in md
    assert "1 × w8a8, 1 × float" in md and "| experts | 60.0% |" in md
    assert "| lm_head | not traceable |" in md
    assert "perplexity max_ratio 1.05: measured 1.3" in md and '{"protect": {"from": 0, "to": 2}}' in md
    assert "| eval | perplexity | max_ratio | 1.05 | 10.2 | 10 | pass |" in md
    assert ("| quant | end-to-end check | uniform w8a8 118, plan 120 (ms) | 3.0% | plan | within the 3.0% noise "
            "margin of the fastest (uniform w8a8) and more accurate |") in md
    html = (run_dir / "report.html").read_text()
    for name in PLOTS:
        assert re.search(rf'<figure id="{name}"><img alt="[^"]+" src="data:image/png;base64,[A-Za-z0-9+/=]{{200,}}"',
                         html)
    assert 'src="report/' not in html  # self-contained
    assert "too sensitive: Δce 0.09" in html
    assert "sensitivity: suffix (top-k 64), 40 units: 25 measured, 15 reused from an earlier attempt" in html


def test_missing_artifacts_are_notes_not_failures(tmp_path: Path) -> None:
    run_dir = fake_run(tmp_path / "r1")
    assert main(["report", str(run_dir)]) == 0
    md = (run_dir / "report.md").read_text()
    assert "no precision plan in this run" in md and "no profile in this run" in md and "no fusion" in md
    assert "no stage of this run chose from timings" in md
    assert "(report/waterfall.png)" in md and not (run_dir / "report" / "precision.png").exists()
    assert "no rollback" in md


def test_report_from_published_files_only(tmp_path: Path) -> None:
    """A run checked out from git has no stages/: the published artifacts are enough."""
    run_dir = _full_run(tmp_path)
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "artifacts" / "quant" / "plan.yaml").is_file()
    shutil.rmtree(run_dir / "stages")
    (run_dir / "report.md").unlink()
    assert main(["report", str(run_dir)]) == 0
    assert "(report/precision.png)" in (run_dir / "report.md").read_text()


def test_report_of_an_unfinished_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "r").mkdir()
    assert main(["report", str(tmp_path / "r")]) == 2
    assert "no summary.json" in capsys.readouterr().err


def test_timeline_segments_and_marks(tmp_path: Path) -> None:
    segments, marks = timeline_data(EventLog(_full_run(tmp_path)).read())
    quant = [s for s in segments if s["stage"] == "quant"]
    assert [s["outcome"] for s in quant] == ["rollback", "done"]
    assert marks[0]["kind"] == "rollback" and "measured 1.3 → retry" in marks[0]["label"]


def test_every_run_writes_its_report(tmp_path: Path) -> None:
    stages = [{"id": "base", "uses": MEASURE, "with": {"baseline": True}},
              {"id": "fast", "uses": MEASURE, "needs": ["base"], "with": {"throughput_tok_s": 300.0}}]
    run_dir = tmp_path / "run"
    assert run_cli("run", write_pipeline(tmp_path / "p.yaml", pipeline(stages)), "--run-dir", run_dir) == 0
    assert "×3.000" in (run_dir / "report.md").read_text()
    assert 'id="waterfall"' in (run_dir / "report.html").read_text()
    assert json.loads((run_dir / "checkpoints.json").read_text())["checkpoints"][0]["stage"] == "base"


def test_a_failing_report_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    def broken(run_dir: Path) -> list[Path]:
        raise RuntimeError("plotting exploded")

    monkeypatch.setattr("opus.report.document.write_report", broken)
    path = write_pipeline(tmp_path / "p.yaml", pipeline([{"id": "base", "uses": MEASURE, "with": {"baseline": True}}]))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    assert "warning: report not written: RuntimeError: plotting exploded" in capsys.readouterr().err
    assert summary(run_dir)["status"] == "finished"


def test_ratios_whose_ranges_overlap_are_marked_within_noise(tmp_path: Path) -> None:
    from opus.report.document import write_report

    # Baseline P 100 and D 100 (each ±10 over the repeats); final P 105 (±10: overlaps), D 60 (±10: does not).
    run_dir = fake_run(tmp_path / "r1", throughput=105.0, ttft=60.0, spread=10.0)
    write_report(run_dir)
    md = (run_dir / "report.md").read_text()
    assert "| P, tokens/s | 100 [90–110] | 105 [95–115] | ×1.050 (within noise) |" in md
    assert "| D, ms to first token | 100 [90–110] | 60 [50–70] | ×0.600 |" in md
    assert "> within noise: the baseline's and the final's [min, max]" in md
    assert "within noise" in (run_dir / "report.html").read_text()
    plain = fake_run(tmp_path / "r2", throughput=105.0)  # no spreads recorded: no judgement
    write_report(plain)
    assert "| P, tokens/s | 100 | 105 | ×1.050 |" in (plain / "report.md").read_text()
