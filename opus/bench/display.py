"""What a person watching ``opus bench`` sees: one progress bar with an ETA, a line per contender.

In a pipe or a log file (no live bar): a plain progress line at least every ``PROGRESS_INTERVAL_S``.
"""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from opus.bench.core import Row
from opus.pipeline.progress import Ticker, format_count, format_duration
from opus.pipeline.summary import headline
from opus.terminal import WIDE_COLUMNS, is_live, progress_interval_s


class BenchDisplay:
    """Progress counts forward passes over all contenders (loading and exporting are not counted);
    a line per contender when its row is complete (a built one's after its group's timed rounds)."""

    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.live = is_live(self.console) and not quiet
        wide = self.console.width >= WIDE_COLUMNS
        self.progress = Progress(
            TextColumn("{task.description}", markup=False,  # contender phases are text, not markup
                       table_column=Column(width=36 if wide else 28, no_wrap=True, overflow="ellipsis")),
            BarColumn(bar_width=24 if wide else 12), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=self.console, transient=True, disable=not self.live)
        self.task: TaskID | None = None
        self.done, self.total, self.what = 0.0, None, "preparing"
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._ticker = Ticker(progress_interval_s(), self._tick)

    def __enter__(self) -> BenchDisplay:
        self.progress.start()
        if not self.live and not self.quiet:
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticker.stop()  # also on Ctrl-C: no line after the command has stopped
        self.progress.stop()

    def start(self, total: float) -> None:
        self.task = self.progress.add_task("bench", total=total)
        self.total, self.started = total, time.monotonic()

    def extend(self, units: float) -> None:
        """More work than planned (rounds measured again because their ratios were too wide)."""
        with self._lock:
            self.total = (self.total or 0) + units
        if self.task is not None:
            self.progress.update(self.task, total=self.total)

    def update(self, done: float, what: str) -> None:
        with self._lock:
            self.done, self.what = done, what
        if self.task is not None:
            self.progress.update(self.task, completed=done, description=what)

    def line(self, text: str) -> None:
        if not self.quiet:
            self._print(Text(text))

    def finished(self, row: Row) -> None:
        if row.status == "ok":
            shown, mark = headline(row.metrics), Text("✓", style="green")
        else:
            shown = f"{row.status}: {row.reason}"
            mark = Text("–", style="yellow") if row.status == "skipped" else Text("✗", style="red")
        if not self.quiet:
            self._print(Text.assemble(mark, f" {row.name:<12} {row.seconds:6.0f}s  {shown}"))

    def _print(self, text: Text) -> None:
        # A log keeps whole lines (soft_wrap); a terminal wraps at its width itself.
        self.progress.console.print(text, soft_wrap=not self.live)

    def _tick(self) -> None:
        with self._lock:
            done, total, what = self.done, self.total, self.what
        elapsed = time.monotonic() - self.started
        eta = elapsed / done * (total - done) if total and done > 0 else None
        self._print(Text(f"… {time.strftime('%H:%M:%S')} bench {what}  {format_count(done, total)}  "
                         f"elapsed {format_duration(elapsed)}  ETA {format_duration(eta)}"))
