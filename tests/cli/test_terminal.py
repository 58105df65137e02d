"""What a person sees: progress in a terminal of any width (a pseudo-terminal), and in a pipe or log.

The end-to-end checks reuse the session's smoke run (conftest ``smoke_run``: ``opus run`` at 80
columns), then resume it at 200 columns and bench it at 80 (each command costs seconds to minutes: one
width each, both widths covered); the display's own checks are fast and cover many widths.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from opus.cli.main import main
from opus.cli.run_display import RunDisplay
from opus.pipeline import progress as run_progress
from opus.pipeline.events import Observers, RunObserver
from opus.pipeline.lock import RunLock
from opus.pipeline.progress import ProgressFile, RunProgress
from tests.pty_helpers import CSI, PtyResult, SmokeRun, run_in_pty, screen_rows

HIDE_CURSOR = "\x1b[?25l"  # rich's live display hides the cursor while it draws: proof it was on
SHOW_CURSOR = "\x1b[?25h"
LONG_NOTE = "n" * 200


def _assert_clean(result: PtyResult, columns: int) -> None:
    assert result.returncode == 0, result.tail()
    assert "Traceback" not in result.output, result.tail()
    assert HIDE_CURSOR in result.output, "no live display: the terminal was not recognised"
    rows = [row for row in screen_rows(result.output) if "ETA" in row]
    assert all(len(row) <= columns for row in rows), max(rows, key=len)


# -- the command line under a terminal --------------------------------------------------------
def test_run_under_a_terminal_80_columns(smoke_run: SmokeRun) -> None:
    _assert_clean(smoke_run.result, 80)
    rows = screen_rows(smoke_run.result.output)
    assert any("ETA" in row and "/" in row for row in rows)  # a stage's bar with done/total
    assert any(row.startswith("✓ baseline") for row in rows)


def test_resume_under_a_wide_terminal(smoke_run: SmokeRun) -> None:
    result = run_in_pty(["resume", smoke_run.run_dir], columns=200, timeout_s=300)
    _assert_clean(result, 200)
    assert any(row.startswith("↺ baseline") for row in screen_rows(result.output))


def test_bench_under_a_narrow_terminal(smoke_run: SmokeRun) -> None:
    small = ["--batch", "1", "--input-len", "16", "--output-len", "4", "--warmup", "0", "--repeats", "1",
             "--eval-samples", "1", "--eval-len", "16"]
    result = run_in_pty(["bench", smoke_run.run_dir, "--only", "fp32,opus", *small], columns=80, timeout_s=600)
    _assert_clean(result, 80)
    assert "# opus bench" in result.output and any(row.startswith("✓ fp32") for row in screen_rows(result.output))


# -- the display alone ---------------------------------------------------------------------
def _fake_run(display: RunDisplay, observer: RunObserver | None = None) -> None:
    """Two stages as the runner reports them (to ``observer``, the display by default): no total at
    first, then counts; a long note and phase."""
    told = observer or display
    told.begin(["baseline", "kv_config", "export"])
    told.started("baseline", "baseline", 0)
    told.update("baseline", {"t": "progress", "done": 0, "total": None, "what": "loading [/b] model"})
    display.progress.refresh()
    for done in (1, 3):
        time.sleep(0.02)
        told.update("baseline", {"t": "progress", "done": done, "total": 10, "what": "P warm-up"})
    display.progress.refresh()
    told.finished("baseline", "done", {"perplexity": 28.6}, 12.5, LONG_NOTE)
    told.started("kv_config", "kv_config", 1)
    told.update("kv_config", {"t": "progress", "done": 2, "total": 128, "what": "phase " + "x" * 150})
    display.progress.refresh()
    told.warn("checkpoint [/x] discarded")


@pytest.mark.parametrize("columns", [80, 200])
def test_live_display_fits_the_terminal(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    out = io.StringIO()
    console = Console(file=out, width=columns, force_terminal=True, color_system=None, highlight=False)
    with RunDisplay(console=console) as display:
        assert display.live
        _fake_run(display)
    rows = screen_rows(out.getvalue())
    bars = [row for row in rows if "ETA" in row]
    assert bars and all(len(row) <= columns for row in bars), max(bars, key=len)
    assert any("3/10" in row for row in bars) and any("loading" in row for row in bars)
    assert any("warning: checkpoint [/x] discarded" in row for row in rows)  # brackets are text
    assert out.getvalue().endswith(SHOW_CURSOR) or SHOW_CURSOR in out.getvalue()


def test_live_display_gives_the_terminal_back_on_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    out = io.StringIO()
    display = RunDisplay(console=Console(file=out, width=80, force_terminal=True, color_system=None))
    with pytest.raises(KeyboardInterrupt), display:
        display.started("baseline", "baseline", 0)
        raise KeyboardInterrupt
    assert not display.progress.live.is_started
    assert SHOW_CURSOR in out.getvalue()


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_pipe_prints_plain_lines_with_etas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPUS_PROGRESS_INTERVAL_S", "0.1")
    monkeypatch.setattr(run_progress, "PROGRESS_FILE_INTERVAL_S", 0.0)
    out = io.StringIO()
    with ProgressFile(tmp_path) as progress_file, \
            RunDisplay(console=Console(file=out, width=80, force_terminal=False)) as display:
        assert not display.live
        _fake_run(display, Observers(progress_file, display))
        _wait_for(lambda: out.getvalue().count("kv_config: phase") >= 2)  # repeated while it runs
        running = json.loads((tmp_path / "progress.json").read_text())["running"]
        assert [(r["stage"], r["done"], r["total"]) for r in running] == [("kv_config", 2, 128)]
    text = out.getvalue()
    assert "\x1b" not in text and not CSI.search(text)
    lines = text.splitlines()
    assert any(LONG_NOTE in line and line.startswith("✓ baseline") for line in lines)  # not wrapped
    progress = [line for line in lines if line.startswith("… ") and "kv_config: phase" in line]
    assert all("2/128" in line and "stage ETA" in line and "run ETA" in line for line in progress)
    assert len(progress[0]) > 80  # a 150-character phase stays on its line
    assert json.loads((tmp_path / "progress.json").read_text())["running"] == []  # the run has ended


def test_pipe_line_comes_even_without_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long phase sends nothing; the log must still show the stage is alive."""
    monkeypatch.setenv("OPUS_PROGRESS_INTERVAL_S", "0.05")
    out = io.StringIO()
    with RunDisplay(console=Console(file=out, force_terminal=False)) as display:
        display.started("plan", "plan", 0)
        _wait_for(lambda: out.getvalue().count("… ") >= 3)
    assert "plan: starting" in out.getvalue()


# -- ETAs and opus status --------------------------------------------------------------------
def test_etas_come_from_measurements_only() -> None:
    run = RunProgress()
    stage = run.start("a", "baseline", 0)
    stage.observe({"done": 0, "total": 10, "what": "P"}, now=100.0)
    stage.observe({"done": 5, "total": 10, "what": "P"}, now=105.0)
    assert stage.eta_s(105.0) == pytest.approx(5.0)
    assert run.run_eta(105.0).seconds is None  # begin() not called: the run's stages are unknown
    run.begin(["a", "b", "c"])
    assert run.run_eta(105.0).text() == "?"  # b and c waiting, no stage has finished yet
    run.finish("a", "done", 20.0)
    stage = run.start("b", "plan", 0)
    stage.observe({"done": 0, "total": None, "what": "x"}, now=200.0)
    assert stage.eta_s(201.0) is None and run.run_eta(201.0).text() == "?"  # no total, no ETA
    stage.observe({"done": 1, "total": 4, "what": "x"}, now=202.0)
    stage.observe({"done": 2, "total": 4, "what": "x"}, now=204.0)
    eta = run.run_eta(204.0)  # b: 2 units at 2 s each; c: the mean of the stages that ran (a, 20 s)
    assert eta.seconds == pytest.approx(24.0) and eta.text() == "~0:24"


def _fake_run_dir(path: Path, created: float) -> Path:
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"run_id": path.name, "created": created}))
    return path


def test_status_without_argument_shows_the_latest_run_and_its_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(run_progress, "PROGRESS_FILE_INTERVAL_S", 0.0)
    runs = tmp_path / "runs"
    latest = _fake_run_dir(runs / "b-older-name", created=2000.0)
    _fake_run_dir(runs / "z-earlier", created=1000.0)
    with RunLock(latest), ProgressFile(latest) as progress_file:
        progress_file.begin(["plan", "quantize"])
        progress_file.started("quantize", "quantize", 0)
        progress_file.update("quantize", {"t": "progress", "done": 12, "total": 40, "what": "calibrating"})
        assert main(["status", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert f"{latest}: running" in out and "latest run" in out
    assert "running quantize (quantize): calibrating  12/40 30%" in out and "run ETA ?" in out


def test_bench_pipe_lines_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from opus.bench.core import Row
    from opus.bench.display import BenchDisplay

    monkeypatch.setenv("OPUS_PROGRESS_INTERVAL_S", "0.05")
    out = io.StringIO()
    with BenchDisplay(console=Console(file=out, width=80, force_terminal=False)) as display:
        display.start(100)
        display.update(30, "fp32: P")
        _wait_for(lambda: "fp32: P  30/100 30%" in out.getvalue())
        display.finished(Row("onnx-int8", "", "onnxruntime", status="failed", reason="shape [/b] " + LONG_NOTE))
    lines = out.getvalue().splitlines()
    assert any("ETA" in line for line in lines if "30/100" in line)
    assert any(line.startswith("✗ onnx-int8") and LONG_NOTE in line for line in lines)


def test_while_torch_compiles_the_line_says_so_and_the_eta_is_unknown() -> None:
    """Minutes of compiling advance no unit: the line says it compiles, and the ETA is "?" (at the rate
    of units it grew to 35 hours while a 30-layer model's decode step compiled); the compile, once
    over, is in the rate (more of them may come)."""
    run = RunProgress()
    run.begin(["kv"])
    stage = run.start("kv", "kv_config", 0)
    stage.observe({"done": 0, "total": 10, "what": "P"}, now=100.0)
    stage.observe({"done": 2, "total": 10, "what": "P"}, now=104.0)  # 2 s a unit
    assert stage.eta_s(104.0) == pytest.approx(16.0)
    stage.observe({"done": 2, "total": 10, "what": "P", "compiling": True}, now=105.0)
    assert stage.label(185.0) == "P · compiling 1:20"
    assert stage.eta_s(185.0) is None and run.run_eta(185.0).text() == "?"
    assert run.snapshot(185.0)["running"][0]["what"] == "P · compiling 1:20"  # what `opus status` shows
    stage.observe({"done": 2, "total": 10, "what": "P", "compiling": False}, now=196.0)
    assert stage.label(196.0) == "P" and stage.eta_s(196.0) == pytest.approx(96 / 2 * 8)
    stage.observe({"done": 2, "total": 10, "what": "P"}, now=197.0)  # a plain message keeps the state
    assert stage.label(197.0) == "P"
    # A phase counted to its end, then a compile (the plan's check builds and compiles its next model):
    # unknown, not 0:00.
    stage.observe({"done": 10, "total": 10, "what": "P", "compiling": True}, now=198.0)
    assert stage.eta_s(199.0) is None
