"""The fuse stage measures the grouped MoE's execution modes on its device, records and replays the choice."""

from __future__ import annotations

import json

import pytest
import torch
from fusion_project import context, make_project

from opus.fusion import linear_ops
from opus.fusion.moe import EXPERT_MODES, grouped_moes
from opus.runtime.timed_choice import run_relative
from stages import fuse

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CFG = fuse.Config(patterns=["moe_grouped"], measure_time=False, experts={"rounds": 2})


@pytest.fixture
def pipeline(tmp_path):
    return make_project(tmp_path, [{"id": "fuse", "uses": "fuse"}])


def _artifact(out, name):
    return json.loads((out / "artifacts" / name).read_text())


def test_modes_are_measured_recorded_and_replayed(pipeline, tmp_path):
    result = fuse.run(context(pipeline, tmp_path / "out", "fuse"), CFG)
    record = _artifact(tmp_path / "out", "fusion.json")["experts"]
    assert record["runnable"] == list(EXPERT_MODES) and record["unavailable"] == {}  # CPU CI measures them all
    decisions = _artifact(tmp_path / "out", "decisions.json")["decisions"]
    assert [d["what"] for d in decisions] == ["MoE experts mode at prefill", "MoE experts mode at decode"]
    for decision in decisions:
        assert [c["name"] for c in decision["candidates"]] == list(EXPERT_MODES)
        assert {len(c["rounds"]) for c in decision["candidates"]} in ({2}, {4})  # 4: measured once more (choose)
    modes = {"prefill": decisions[0]["winner"], "decode": decisions[1]["winner"]}
    assert record["modes"] == modes and result.recipe[0].experts == modes
    assert all(m.modes == modes for _, m in grouped_moes(result.model))
    assert result.metrics["fusion_exact_match"] == 1.0  # checked with the chosen modes in place
    # run.decisions_from: the earlier run's modes, nothing timed.
    earlier = tmp_path / "earlier" / "artifacts" / "fuse"
    earlier.mkdir(parents=True)
    chosen = {"prefill": "grouped", "decode": "dense"}
    (earlier / "fusion.json").write_text(json.dumps({"experts": {"modes": chosen}}))
    ctx = context(pipeline, tmp_path / "again", "fuse")
    ctx.spec.run.decisions_from = str(tmp_path / "earlier")
    again = fuse.run(ctx, CFG)
    assert again.recipe[0].experts == chosen
    replayed = _artifact(tmp_path / "again", "decisions.json")["decisions"]
    assert [d["winner"] for d in replayed] == ["grouped", "dense"]
    assert all(d["replayed_from"] == run_relative(str(earlier / "fusion.json")) for d in replayed)


def test_a_mode_that_cannot_run_is_reported_with_the_reason(pipeline, tmp_path, monkeypatch):
    monkeypatch.setitem(linear_ops._GROUPED_OK, ("cpu", torch.float32), False)
    monkeypatch.setitem(linear_ops._GROUPED_WHY, ("cpu", torch.float32), "torch._grouped_mm needs CUDA here")
    result = fuse.run(context(pipeline, tmp_path / "out", "fuse"), CFG)
    record = _artifact(tmp_path / "out", "fusion.json")["experts"]
    assert record["runnable"] == ["sorted", "dense", "compiled"]
    assert record["unavailable"] == {"grouped": "model.layers.0.mlp: torch._grouped_mm needs CUDA here"}
    assert set(result.recipe[0].experts.values()) <= {"sorted", "dense", "compiled"}


def test_switched_off_the_step_is_as_before(pipeline, tmp_path):
    cfg = CFG.model_copy(update={"experts": fuse.Experts(choose=False)})
    result = fuse.run(context(pipeline, tmp_path / "out", "fuse"), cfg)
    assert result.recipe[0].experts is None
    assert _artifact(tmp_path / "out", "fusion.json")["experts"] is None
    assert not (tmp_path / "out" / "artifacts" / "decisions.json").exists()
