"""Finished units inside a stage: kept atomically per (stage key, configuration), reused by the next
attempt, dropped once the stage's checkpoint is committed."""

from __future__ import annotations

from pathlib import Path

from opus.pipeline.units import UNITS_DIR, UnitStore, unit_scope
from tests.helpers import pipeline, run_cli, statuses, summary, write_pipeline

UNITS = "tests.fixtures.stages.units"


def test_a_store_returns_what_was_put_and_ignores_damaged_or_foreign_files(tmp_path: Path) -> None:
    store = UnitStore(tmp_path / "s")
    assert store.get("a/b c") is None
    store.put("a/b c", {"dce": 0.1 + 0.2, "how": "suffix"})
    again = UnitStore(tmp_path / "s")
    assert again.get("a/b c") == {"dce": 0.1 + 0.2, "how": "suffix"}  # floats round-trip exactly
    assert (again.reused, store.stored, again.finished()) == (1, 1, 1)
    (path,) = (tmp_path / "s").glob("*.json")
    path.write_text('{"unit": "a/b c", "val')  # a torn write that got past the rename
    assert UnitStore(tmp_path / "s").get("a/b c") is None
    path.write_text('{"unit": "other", "value": 1}')
    assert UnitStore(tmp_path / "s").get("a/b c") is None


def test_the_scope_follows_the_key_and_the_configuration() -> None:
    assert unit_scope("k", {"top_k": 64}) == unit_scope("k", {"top_k": 64})
    assert unit_scope("k", {"top_k": 64}) != unit_scope("k", {"top_k": 32})  # a retry with a remedy
    assert unit_scope("k", {"top_k": 64}) != unit_scope("k2", {"top_k": 64})


def test_a_crashed_stage_retries_with_only_the_unfinished_units_then_drops_them(tmp_path: Path) -> None:
    stage = {"id": "sweep", "uses": UNITS, "with": {"count": 7, "crash_after": 3}, "on_fail": "retry",
             "retries": 1}
    path = write_pipeline(tmp_path / "p.yaml", pipeline([stage]))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir) == 0
    assert statuses(run_dir) == {"sweep": "done"}
    (record,) = summary(run_dir)["stages"]
    assert record["attempts"] == 2
    assert record["metrics"] == {"sum": sum(i * i for i in range(7)), "measured": 4, "reused": 3}
    assert not (run_dir / "stages" / UNITS_DIR).exists()
