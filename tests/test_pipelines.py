"""The shipped pipelines: valid, and smoke.yaml runs every stage type end to end on the K3 demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from opus.pipeline.graph import validate
from opus.pipeline.registry import known_stage_types
from opus.pipeline.spec import load_pipeline
from tests.helpers import run_cli, statuses
from tests.pty_helpers import SmokeRun

PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


@pytest.mark.parametrize("name", ["k3.yaml", "smoke.yaml"])
def test_pipeline_is_valid(name: str) -> None:
    loaded = load_pipeline(PIPELINES / name)
    graph, _ = validate(loaded)
    assert len(graph) == len(loaded.spec.stages)


def test_smoke_covers_every_stage_type() -> None:
    used = {s["uses"] for s in yaml.safe_load((PIPELINES / "smoke.yaml").read_text())["stages"]}
    assert used == set(known_stage_types())


def test_smoke_runs_end_to_end_then_reuses_everything(smoke_run: SmokeRun) -> None:
    # The session's smoke run (conftest), under a terminal as a person would start it.
    run_dir = smoke_run.run_dir
    assert smoke_run.result.returncode == 0, smoke_run.result.tail()
    result = smoke_run.summary
    assert result is not None and result["status"] == "finished"
    for key in ("throughput_tok_s", "ttft_ms", "perplexity", "peak_mem_mb"):
        assert result["baseline"][key] > 0 and result["final"][key] > 0
    assert 0 <= result["final"]["agreement"] <= 1
    kept = {s["id"]: s for s in result["stages"]}
    assert kept["quantize"]["status"] in ("done", "rolled_back") and kept["eval"]["status"] == "done"
    (plan_dir,) = (run_dir / "stages").glob("*-plan")
    plan = yaml.safe_load((plan_dir / "artifacts" / "plan.yaml").read_text())
    assert plan["groups"] and all(g["reason"] for g in plan["groups"])
    assert (run_dir / "report.md").is_file() and (run_dir / "report.html").is_file()
    recipe = json.loads(((run_dir / "stages").glob("*-eval").__next__() / "state.json").read_text())["recipe"]
    assert [step["kind"] for step in recipe][:1] == ["quantize"] or kept["quantize"]["status"] == "rolled_back"
    assert run_cli("run", PIPELINES / "smoke.yaml", "--run-dir", run_dir) == 0
    assert set(statuses(run_dir).values()) <= {"cached", "rolled_back"}
