"""The plan stage's sweep on a local two-CPU Ray cluster makes the plan the stage makes alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from opus.report.document import write_report
from tests.bench.project import make_project
from tests.helpers import events, run_cli, statuses

PLAN = {"id": "plan", "uses": "plan",
        "with": {"formats": ["w8a8", "w8a16", "w4a16"], "group_size": 32, "end_to_end_check": False, "rounds": 3}}
RAY = {"ray": {"address": "local", "local_cpus": 2, "units_per_task": 3}}


def _pipeline(root: Path, executor: object) -> Path:
    """The bench project's tiny Llama, its text as calibration data, and a plan stage alone."""
    path = make_project(root)
    spec = yaml.safe_load(path.read_text())
    spec.update(data={"calibration": spec["data"]["evaluation"]}, stages=[PLAN])
    spec.setdefault("run", {})["executor"] = executor
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _plan(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "artifacts" / "plan" / "plan.yaml").read_text())


def test_a_plan_made_on_ray_is_the_plan_made_locally(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'opus[ray]'); make test installs it")
    local, remote = tmp_path / "local", tmp_path / "ray"
    assert run_cli("run", _pipeline(tmp_path / "a", "local"), "--run-dir", local) == 0
    assert run_cli("run", _pipeline(tmp_path / "b", RAY), "--run-dir", remote) == 0
    assert statuses(remote) == {"plan": "done"}
    here, there = _plan(local), _plan(remote)
    assert [(g["name"], g["format"]) for g in there["groups"]] == [(g["name"], g["format"]) for g in here["groups"]]
    for mine, theirs in zip(here["groups"], there["groups"]):
        assert theirs["score"].keys() == mine["score"].keys()
        for fmt, value in mine["score"].items():
            assert theirs["score"][fmt] == pytest.approx(value, rel=1e-4, abs=1e-7)
        assert "scored_on" not in mine and " pid " in str(theirs["scored_on"])
    sweep = there["sensitivity"]
    assert sum(sweep["ran_on"].values()) == sweep["units"] == sweep["measured"]
    assert here["sensitivity"]["ran_on"] == {"this process": sweep["units"]}
    assert all("(node " in where for where in sweep["ran_on"])
    connected = [e for e in events(remote) if e["event"] == "cluster_connected"]
    assert [(e["stage"], e["cpus"], e["slots"]) for e in connected] == [("plan", 2.0, 2)]
    assert any(e["event"] == "cluster_released" for e in events(remote))
    write_report(remote)
    line = next(x for x in (remote / "report.md").read_text().splitlines() if x.startswith("scored on: "))
    assert all(f"{where}: {n} units" in line for where, n in sweep["ran_on"].items())


def test_a_pipeline_asking_for_ray_where_it_is_missing_fails_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("opus.pipeline.preflight.ray_installed", lambda: False)
    path = _pipeline(tmp_path, RAY)
    capsys.readouterr()  # what building the project printed
    assert run_cli("run", path, "--run-dir", tmp_path / "run") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.executor" in err[0] and "pip install 'opus[ray]'" in err[0], err
    assert str(path) in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "run" / "stages").exists()
