"""The run's structured log: one JSON object per line in ``events.jsonl``, flushed and fsynced."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

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
