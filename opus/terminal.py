"""What every display that draws on a terminal shares (rich): when to draw live, how wide is wide, a
column of one line, how often a log gets a progress line. The run's display is opus.cli.run_display,
the bench's opus.bench.display; the run engine draws nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rich.console import Console
from rich.progress import ProgressColumn, Task
from rich.table import Column
from rich.text import Text

# Pipe/log mode: a progress line per running stage at least this often (OPUS_PROGRESS_INTERVAL_S
# overrides it; the tests use a fraction of a second).
PROGRESS_INTERVAL_S = 30.0
# Below this width the bars and labels shrink so a row still fits on one line.
WIDE_COLUMNS = 120


def progress_interval_s() -> float:
    try:
        return float(os.environ.get("OPUS_PROGRESS_INTERVAL_S", PROGRESS_INTERVAL_S))
    except ValueError:
        return PROGRESS_INTERVAL_S


def is_live(console: Console) -> bool:
    """A live display needs a terminal that moves the cursor; TERM=dumb and pipes get plain lines."""
    return console.is_terminal and not console.is_dumb_terminal


class FieldColumn(ProgressColumn):
    """Text from a function of the task, one line, cut with an ellipsis when the row is too wide."""

    def __init__(self, text: Callable[[Task], str], width: int | None = None, style: str = "") -> None:
        self.text, self.style = text, style
        super().__init__(table_column=Column(width=width, no_wrap=width is not None))

    def render(self, task: Task) -> Text:
        return Text(self.text(task), style=self.style, no_wrap=True, overflow="ellipsis")
