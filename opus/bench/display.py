"""What a person watching ``opus bench`` sees: one progress bar with an ETA, a line per contender."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from opus.bench.core import Row
from opus.console import headline


class BenchDisplay:
    """Progress counts forward passes over all contenders (loading and exporting are not counted)."""

    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.progress = Progress(
            TextColumn("{task.description:<36}"), BarColumn(bar_width=24), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=self.console, transient=True,
            disable=quiet or not self.console.is_terminal)
        self.task = None

    def __enter__(self) -> BenchDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start(self, total: float) -> None:
        self.task = self.progress.add_task("bench", total=total)

    def update(self, done: float, what: str) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=done, description=what[:36])

    def line(self, text: str) -> None:
        if not self.quiet:
            self.progress.console.print(text)

    def finished(self, row: Row) -> None:
        if row.status == "ok":
            shown = headline(row.metrics)
            mark = "[green]✓[/]"
        else:
            shown = f"{row.status}: {row.reason}"
            mark = "[yellow]–[/]" if row.status == "skipped" else "[red]✗[/]"
        self.line(f"{mark} {row.name:<12} {row.seconds:6.0f}s  {shown}")
