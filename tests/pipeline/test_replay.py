"""``opus run P --decisions-from RUN_DIR``: a run replays the timing decisions of an earlier one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from opus.runtime.timed_choice import run_relative
from tests.bench.project import make_project
from tests.helpers import run_cli, statuses

PLAN = {"id": "plan", "uses": "plan",
        "with": {"formats": ["w8a16", "w4a16"], "group_size": 32, "end_to_end_check": False, "rounds": 3}}


def _pipeline(root: Path) -> Path:
    """The bench project's tiny Llama, its text as calibration data, and a plan stage alone."""
    path = make_project(root)
    spec = yaml.safe_load(path.read_text())
    spec.update(data={"calibration": spec["data"]["evaluation"]}, stages=[PLAN])
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _plan(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "artifacts" / "plan" / "plan.yaml").read_text())


def test_a_run_replays_the_plan_of_an_earlier_one(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path)
    first = tmp_path / "first"
    assert run_cli("run", pipeline, "--run-dir", first) == 0
    decisions = json.loads((first / "artifacts" / "plan" / "decisions.json").read_text())["decisions"]
    assert decisions and all(d["what"].startswith("kernel formats: ") and d["winner"] in d["tied"] for d in decisions)
    # Change the earlier run's decisions: the replay must follow them, not this machine's timings.
    earlier = _plan(first)
    for group in earlier["groups"]:
        group["format"] = "w4a16" if group["format"] == "w8a16" else "w8a16"
    (first / "artifacts" / "plan" / "plan.yaml").write_text(yaml.safe_dump(earlier, sort_keys=False))

    second = tmp_path / "second"
    assert run_cli("run", pipeline, "--run-dir", second, "--decisions-from", first) == 0
    assert [(g["name"], g["format"]) for g in _plan(second)["groups"]] == \
        [(g["name"], g["format"]) for g in earlier["groups"]]
    (record,) = json.loads((second / "artifacts" / "plan" / "decisions.json").read_text())["decisions"]
    assert record["replayed_from"] == run_relative(str((first / "artifacts" / "plan" / "plan.yaml").resolve()))
    # The flag is a pipeline setting: recorded in the run's pipeline.yaml (relative to the pipeline file, as
    # every path there), so a resume replays too.
    assert yaml.safe_load((second / "pipeline.yaml").read_text())["run"]["decisions_from"] == \
        os.path.relpath(first.resolve(), pipeline.parent.resolve())
    assert run_cli("resume", second) == 0 and statuses(second) == {"plan": "cached"}
