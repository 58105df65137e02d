"""The plan stage's sweep on a local two-CPU Ray cluster makes the plan the stage makes alone.

A plan is the sweep's scores plus kernel timings; Ray changes only where the scores are computed. The
pipeline test checks the scores (timings are measured afresh by each run, so two runs may tie-break
differently); the in-process test holds the timings fixed and checks the whole assignment."""

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


def test_the_plan_stage_on_ray_scores_as_it_does_alone_and_says_where(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'opus[ray]'); make test installs it")
    local, remote = tmp_path / "local", tmp_path / "ray"
    assert run_cli("run", _pipeline(tmp_path / "a", "local"), "--run-dir", local) == 0
    assert run_cli("run", _pipeline(tmp_path / "b", RAY), "--run-dir", remote) == 0
    assert statuses(remote) == {"plan": "done"}
    here, there = _plan(local), _plan(remote)
    assert [g["name"] for g in there["groups"]] == [g["name"] for g in here["groups"]]
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
    assert "| scored on |" in (remote / "report.md").read_text()


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


@pytest.mark.parametrize("method", ["suffix", "taylor"])
def test_with_the_same_timings_the_plan_made_on_ray_is_the_plan_made_locally(method: str) -> None:
    """Suffix trials fan out by unit; the Taylor proxy by calibration batch (with SmoothQuant's input
    scales shipped beside the model for its W8A8 scores): the same scores and the same assignment."""
    pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'opus[ray]'); make test installs it")
    from opus.cluster.ray_pool import ray_pool
    from opus.cluster.settings import RaySettings
    from opus.pipeline.spec import WorkloadSpec
    from opus.quant import plan as planner
    from opus.quant.calibrate import collect_stats
    from opus.quant.sensitivity import Scoring
    from tests.quant.tiny import blocks, tiny_decoder

    timed: dict[str, dict[str, list[float]]] = {}  # the first plan's kernel timings, reused by the second
    workload = WorkloadSpec(batch_size=2, input_len=16, output_len=4)

    def make(cluster):  # noqa: ANN001, ANN202
        model = tiny_decoder("mixtral", outlier=20.0)
        data = blocks(8, 32)  # two calibration batches of four blocks
        request = planner.PlanRequest(["w8a8", "w8a16", "w4a16"], budget_value=0.05, group_size=32, rounds=3,
                                      cluster=cluster, timings=timed, scoring=Scoring(method))
        return planner.make_plan(model, data, collect_stats(model, data), request, workload)[0]

    here = make(None)
    assert timed  # filled by the first plan
    there = make(lambda: ray_pool(RaySettings(local_cpus=2, units_per_task=5)))
    assert [(g.name, g.format) for g in there.groups] == [(g.name, g.format) for g in here.groups]
    for mine, theirs in zip(here.groups, there.groups):
        assert theirs.score == pytest.approx(mine.score, rel=1e-4, abs=1e-7)
    ran_on = there.sensitivity["ran_on"]
    if method == "suffix":
        assert len(ran_on) == 2  # two workers, five tasks of at most five units
    else:  # every unit from both batches, one task each
        (where,) = ran_on
        assert where.startswith("2 calibration-batch tasks on ") and " pid " in where, where
        assert all(s.scored_by.startswith("taylor proxy") for s in there.groups if s.scored_by)
