"""Finished units of work inside a stage, kept across attempts: a stage stopped half-way resumes there.

A stage that splits long work into units (the plan stage: one (group, format) sensitivity score each)
writes every finished unit at once, as one small JSON file, atomically, under

    <run>/stages/.units/<stage id>/<scope>/<store>/<unit>.json

The scope is a digest of the stage key and the attempt's configuration: the key covers the stage's
definition, code, inputs and data, and a retry with a remedy keeps the key but changes the
configuration, so units are reused exactly where they would come out the same. The runner removes a
stage's units once its checkpoint is committed; a stage killed, crashed or stalled keeps them, so the
next attempt (or ``opus resume``) measures only the units not finished.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from opus.atomic import read_json, write_json

UNITS_DIR = ".units"
_UNSAFE = re.compile(r"[^A-Za-z0-9._@=-]")


def units_root(stages_dir: Path, stage_id: str) -> Path:
    return stages_dir / UNITS_DIR / stage_id


def unit_scope(key: str, config: dict[str, Any]) -> str:
    payload = json.dumps({"key": key, "config": config}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def clear_units(stages_dir: Path, stage_id: str) -> None:
    """Drop a stage's finished units (its checkpoint holds the result now)."""
    shutil.rmtree(units_root(stages_dir, stage_id), ignore_errors=True)
    try:
        (stages_dir / UNITS_DIR).rmdir()  # the last stage's: leave no empty folder behind
    except OSError:
        pass  # another stage still keeps units there


class UnitStore:
    """``get(unit)`` a finished unit's value or None; ``put(unit, value)`` one just finished.

    Counts what it served (``reused``) and what it was given (``stored``), for progress and reports."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.reused = 0
        self.stored = 0

    def _path(self, unit: str) -> Path:
        # Readable and collision-free: the unit's name made safe for a file name, plus its own digest.
        digest = hashlib.sha256(unit.encode()).hexdigest()[:12]
        return self.dir / f"{_UNSAFE.sub('_', unit)[:120]}-{digest}.json"

    def get(self, unit: str) -> Any | None:
        path = self._path(unit)
        try:
            record = read_json(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # damaged (a disk error): measured again, never trusted
            return None
        if not isinstance(record, dict) or record.get("unit") != unit:
            return None
        self.reused += 1
        return record["value"]

    def put(self, unit: str, value: Any) -> None:
        write_json(self._path(unit), {"unit": unit, "value": value})
        self.stored += 1

    def finished(self) -> int:
        """Units on disk now (from every attempt in this scope)."""
        return sum(1 for _ in self.dir.glob("*.json")) if self.dir.is_dir() else 0
