"""What a person watching ``opus run`` sees (rich): an observer of the run engine.

In an interactive terminal: a live bar per running stage (phase, done/total, elapsed, ETA of the
stage and of the run) and one line per finished stage. In a pipe or a log file: plain lines, never
wrapped, one per running stage at least every ``PROGRESS_INTERVAL_S``, and one per finished stage.
progress.json (for ``opus status``) is the engine's own (opus.pipeline.progress.ProgressFile).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

from opus.pipeline.progress import RunProgress, StageProgress, Ticker, format_count, format_duration
from opus.pipeline.summary import headline
from opus.terminal import WIDE_COLUMNS, FieldColumn, is_live, progress_interval_s

MARKS = {"done": ("✓", "green"), "cached": ("↺", "cyan"), "rolled_back": ("↶", "yellow")}


class RunDisplay:
    """The run's observer for a person (opus.pipeline.events.RunObserver).

    ``update`` runs on the worker listener's thread, the rest on the main thread, pipe-mode lines on
    a ticker thread: the state is shared under one lock.
    """

    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.live = is_live(self.console) and not quiet
        self.run = RunProgress()
        self.tasks: dict[str, TaskID] = {}
        self.interval_s = progress_interval_s()
        self.wide = self.console.width >= WIDE_COLUMNS
        self._lock = threading.RLock()
        self.progress = self._progress()
        self._ticker = Ticker(min(1.0, self.interval_s), self._tick)

    def _progress(self) -> Progress:
        wide = self.wide
        return Progress(
            TextColumn("{task.description}", markup=False,
                       table_column=Column(width=30 if wide else 14, no_wrap=True, overflow="ellipsis")),
            BarColumn(bar_width=24 if wide else 10),
            FieldColumn(lambda t: format_count(self._stage(t).done, self._stage(t).total), width=15 if wide else 11),
            *([TimeElapsedColumn()] if wide else []),  # narrow: the phase needs the room more
            FieldColumn(lambda t: f"ETA {format_duration(self._stage(t).eta_s(time.monotonic()))}", width=10),
            FieldColumn(lambda t: f"run {self.run.run_eta(time.monotonic()).text()}", width=12, style="dim"),
            FieldColumn(lambda t: self._stage(t).label(time.monotonic())),
            console=self.console, transient=True, disable=not self.live)

    @staticmethod
    def _stage(task: Task) -> StageProgress:
        return task.fields["stage"]

    def __enter__(self) -> RunDisplay:
        self.progress.start()
        self._ticker.start()  # a log's lines: a stage may go quiet for long after its last message
        return self

    def __exit__(self, *exc: object) -> None:
        # Also on Ctrl-C: the live display must give the terminal back (cursor, no half-drawn bars).
        self._ticker.stop()
        self.progress.stop()

    # -- the runner's calls ----------------------------------------------------------------
    def begin(self, stage_ids: list[str]) -> None:
        """The run's stages in order (for the run's ETA)."""
        with self._lock:
            self.run.begin(stage_ids)

    def started(self, stage_id: str, uses: str, attempt: int) -> None:
        label = f"{stage_id} ({uses})" + (f" retry {attempt}" if attempt else "")
        short = stage_id + (f" r{attempt}" if attempt else "")  # a narrow bar keeps room for the phase
        with self._lock:
            stage = self.run.start(stage_id, uses, attempt)
            self.tasks[stage_id] = self.progress.add_task(label if self.wide else short, total=None, stage=stage)
            if not self.live:
                self._print(Text(f"▸ {label} started"))

    def update(self, stage_id: str, message: dict[str, Any]) -> None:
        with self._lock:
            stage, task = self.run.observe(stage_id, message, time.monotonic()), self.tasks.get(stage_id)
            if stage is not None and task is not None:
                self._show(task, stage)

    def _show(self, task_id: TaskID, stage: StageProgress) -> None:
        self.progress.update(task_id, completed=stage.done or 0, total=stage.total)
        if stage.total is None:
            # update() cannot clear a total: a phase without one pulses instead of showing the last one's
            for task in self.progress.tasks:
                if task.id == task_id:
                    task.total = None

    def finished(self, stage_id: str, status: str, metrics: dict[str, Any], seconds: float | None,
                 note: str = "") -> None:
        with self._lock:
            task = self.tasks.pop(stage_id, None)
            if task is not None:
                self.progress.remove_task(task)
            self.run.finish(stage_id, status, seconds)
        mark, color = MARKS.get(status, ("✗", "red"))
        took = f"{seconds:7.1f}s" if seconds is not None else " " * 8
        text = Text(mark, style=color)
        text.append(f" {stage_id:<20} {status:<12} {took}  {headline(metrics)} {note}".rstrip())
        self._print(text)

    def line(self, text: str) -> None:
        self._print(Text(text))

    def warn(self, text: str) -> None:
        self._print(Text.assemble(("warning:", "yellow"), f" {text}"), always=True)

    # -- output ----------------------------------------------------------------------------
    def _print(self, text: Text, always: bool = False) -> None:
        """Text objects, not markup: notes and paths may hold brackets rich would parse."""
        if self.quiet and not always:
            return
        with self._lock:
            # A log keeps whole lines (soft_wrap); a terminal wraps at its width itself.
            self.progress.console.print(text, soft_wrap=not self.live)

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self.live or self.quiet:
                return
            due = [s for s in self.run.running.values() if now - s.last_printed >= self.interval_s]
            for stage in due:
                stage.last_printed = now
                self._print(Text(self.progress_line(stage, now)))

    def progress_line(self, stage: StageProgress, now: float) -> str:
        """Pipe/log mode's line: time, stage, phase, done/total, elapsed, ETA of the stage and the run."""
        return (f"… {time.strftime('%H:%M:%S')} {stage.stage_id}: {stage.label(now)}  "
                f"{format_count(stage.done, stage.total)}  elapsed {format_duration(now - stage.started)}  "
                f"stage ETA {format_duration(stage.eta_s(now))}  run ETA {self.run.run_eta(now).text()}")
