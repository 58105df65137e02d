"""What the run engine tells: the structured log (one JSON object per line in ``events.jsonl``, flushed
and fsynced) and the calls its observers get (``RunObserver``).

The engine draws nothing: a terminal's bars, a log's lines (opus.cli.run_display) and progress.json
(opus.pipeline.progress.ProgressFile) are observers of the same calls.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

EVENTS_FILE = "events.jsonl"


class EventLog:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / EVENTS_FILE

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, default=str) + "\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        return record

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a torn last line after a power cut
        return out


class RunObserver(Protocol):
    """The runner's calls, in order: begin, then per stage attempt started, update*, finished; line and
    warn anywhere. ``update`` comes on the worker listener's thread, the rest on the runner's."""

    def begin(self, stage_ids: list[str]) -> None: ...

    def started(self, stage_id: str, uses: str, attempt: int) -> None: ...

    def update(self, stage_id: str, message: dict[str, Any]) -> None: ...

    def finished(self, stage_id: str, status: str, metrics: dict[str, Any], seconds: float | None,
                 note: str = "") -> None: ...

    def line(self, text: str) -> None: ...

    def warn(self, text: str) -> None: ...


class Unobserved:
    """An observer that shows nothing (``opus verify`` plans a resume and runs nothing)."""

    def begin(self, stage_ids: list[str]) -> None:
        pass

    def started(self, stage_id: str, uses: str, attempt: int) -> None:
        pass

    def update(self, stage_id: str, message: dict[str, Any]) -> None:
        pass

    def finished(self, stage_id: str, status: str, metrics: dict[str, Any], seconds: float | None,
                 note: str = "") -> None:
        pass

    def line(self, text: str) -> None:
        pass

    def warn(self, text: str) -> None:
        pass


class Observers:
    """Several observers as one: each call goes to each, in order."""

    def __init__(self, *observers: RunObserver) -> None:
        self.observers = observers

    def begin(self, stage_ids: list[str]) -> None:
        for observer in self.observers:
            observer.begin(stage_ids)

    def started(self, stage_id: str, uses: str, attempt: int) -> None:
        for observer in self.observers:
            observer.started(stage_id, uses, attempt)

    def update(self, stage_id: str, message: dict[str, Any]) -> None:
        for observer in self.observers:
            observer.update(stage_id, message)

    def finished(self, stage_id: str, status: str, metrics: dict[str, Any], seconds: float | None,
                 note: str = "") -> None:
        for observer in self.observers:
            observer.finished(stage_id, status, metrics, seconds, note)

    def line(self, text: str) -> None:
        for observer in self.observers:
            observer.line(text)

    def warn(self, text: str) -> None:
        for observer in self.observers:
            observer.warn(text)
