"""What a person watching the run sees: one line per stage with progress and ETA (rich)."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

HEADLINE = (("throughput_tok_s", "P", "{:.1f} tok/s"), ("ttft_ms", "D", "{:.1f} ms"),
            ("perplexity", "ppl", "{:.3f}"), ("agreement", "agree", "{:.3f}"))


def headline(metrics: dict[str, Any]) -> str:
    parts = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in HEADLINE
             if isinstance(metrics.get(key), (int, float))]
    return "  ".join(parts)


class RunDisplay:
    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.progress = Progress(
            TextColumn("{task.description:<28}"), BarColumn(bar_width=24),
            TextColumn("{task.completed:>5.0f}/{task.total:<5.0f}"), TimeElapsedColumn(),
            TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[what]}"),
            console=self.console, transient=True, disable=quiet or not self.console.is_terminal)
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RunDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def line(self, text: str) -> None:
        if not self.quiet:
            self.progress.console.print(text)

    def warn(self, text: str) -> None:
        self.progress.console.print(f"[yellow]warning:[/] {text}")

    def started(self, stage_id: str, uses: str, attempt: int) -> None:
        label = f"{stage_id} ({uses})" + (f" retry {attempt}" if attempt else "")
        self.tasks[stage_id] = self.progress.add_task(label, total=None, what="starting")

    def update(self, stage_id: str, message: dict[str, Any]) -> None:
        task = self.tasks.get(stage_id)
        if task is None or message.get("t") != "progress":
            return
        self.progress.update(task, completed=message.get("done") or 0, total=message.get("total"),
                             what=message.get("what", ""))

    def finished(self, stage_id: str, status: str, metrics: dict[str, Any], seconds: float | None,
                 note: str = "") -> None:
        task = self.tasks.pop(stage_id, None)
        if task is not None:
            self.progress.remove_task(task)
        mark = {"done": "[green]✓[/]", "cached": "[cyan]↺[/]", "rolled_back": "[yellow]↶[/]"}.get(
            status, "[red]✗[/]")
        took = f"{seconds:7.1f}s" if seconds is not None else " " * 8
        self.line(f"{mark} {stage_id:<20} {status:<12} {took}  {headline(metrics)} {note}".rstrip())


def plain_console() -> Console:
    return Console(stderr=True, highlight=False, force_terminal=sys.stderr.isatty())
