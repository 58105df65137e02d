"""The fuse stage: metrics, fusion.json, the recipe step, the equivalence check and its remedy."""

from __future__ import annotations

import json

import pytest
from fusion_project import context, make_project

from opus.fusion import PATTERNS, GroupedMoE
from opus.pipeline.contracts import Failure
from opus.pipeline.preflight import undeclared_metrics
from opus.runtime.timed_choice import run_relative
from stages import fuse

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture
def pipeline(tmp_path):
    return make_project(tmp_path, [{"id": "fuse", "uses": "fuse"}])


def test_fuse_stage_reports_and_records(pipeline, tmp_path):
    result = fuse.run(context(pipeline, tmp_path / "out", "fuse"), fuse.Config(measure_time=False))
    m = result.metrics
    assert m["fusion_exact_match"] == 1.0 and m["fusion_cosine"] > 0.99999 and m["fusion_check_passed"] == 1.0
    assert m["ops_after"] < m["ops_before"] and m["nodes_after"] < m["nodes_before"]
    assert m["ops_prefill_after"] + m["ops_decode_after"] == m["ops_after"]
    assert m["sites_fused"] > 0 and m["regions_ignored"] == 0
    assert not undeclared_metrics(fuse, m)  # what gates are checked against before a run
    assert [s.kind for s in result.recipe] == ["fuse"]
    assert isinstance(result.model.model.layers[0].mlp, GroupedMoE)
    report = json.loads((tmp_path / "out" / "artifacts" / "fusion.json").read_text())
    assert set(report["patterns"]) == set(PATTERNS) == set(fuse.ALL_PATTERNS)
    assert report["patterns"]["moe_grouped"] == {"fused": 2, "skipped": 0, "reasons": []}
    for key in ("ops_before", "ops_after", "nodes_before", "nodes_after", "ignored", "equivalence", "how"):
        assert key in report, key
    assert report["equivalence"]["failures"] == []


def test_timing_fields_when_measured(pipeline, tmp_path):
    cfg = fuse.Config(patterns=["qkv"], measure_time=True)
    m = fuse.run(context(pipeline, tmp_path / "out", "fuse"), cfg).metrics
    for key in ("decode_ms_before", "decode_ms_after", "dispatch_share_before", "dispatch_share_after"):
        assert m[key] > 0, key  # values are machine-dependent: only their presence is asserted


def test_compile_choice_is_a_recorded_decision_and_replays(pipeline, tmp_path):
    cfg = fuse.Config(patterns=["qkv"], measure_time=False,
                      compile={"enabled": True, "backend": "eager", "rounds": 3})  # eager: dynamo alone, quick
    result = fuse.run(context(pipeline, tmp_path / "out", "fuse"), cfg)
    (decision,) = json.loads((tmp_path / "out" / "artifacts" / "decisions.json").read_text())["decisions"]
    assert [c["name"] for c in decision["candidates"]] == ["eager", "compiled"]
    assert {len(c["rounds"]) for c in decision["candidates"]} in ({3}, {6})  # 6: measured once more (choose)
    kept = decision["winner"] == "compiled"
    assert decision["winner"] in decision["tied"] and result.metrics["compile_kept"] == float(kept)
    record = json.loads((tmp_path / "out" / "artifacts" / "fusion.json").read_text())["compile"]
    assert record["kept"] == kept and record["margin"] == decision["margin"]
    # An earlier run that kept the compile: replayed as it was, nothing timed.
    earlier = tmp_path / "earlier" / "artifacts" / "fuse"
    earlier.mkdir(parents=True)
    settings = {"backend": "eager", "mode": None, "dynamic": None}
    (earlier / "fusion.json").write_text(json.dumps({"compile": {"kept": True, "settings": settings}}))
    ctx = context(pipeline, tmp_path / "again", "fuse")
    ctx.spec.run.decisions_from = str(tmp_path / "earlier")
    again = fuse.run(ctx, cfg)
    assert again.metrics["compile_kept"] == 1.0 and "decode_ms_eager" not in again.metrics
    assert again.recipe[0].compile == settings
    (replayed,) = json.loads((tmp_path / "again" / "artifacts" / "decisions.json").read_text())["decisions"]
    assert replayed["winner"] == "compiled" and replayed["replayed_from"] == run_relative(str(earlier / "fusion.json"))


def test_failed_check_fails_loudly_or_reports(pipeline, tmp_path):
    strict = fuse.Config(measure_time=False, patterns=["qkv"], check={"min_cosine": 1.5})  # impossible on purpose
    with pytest.raises(RuntimeError, match="fusion_cosine .* < 1.5"):
        fuse.run(context(pipeline, tmp_path / "a", "fuse"), strict)
    assert (tmp_path / "a" / "artifacts" / "fusion.json").is_file()  # evidence for the rollback record
    report = strict.model_copy(update={"check": fuse.Check(min_cosine=1.5, action="report")})
    m = fuse.run(context(pipeline, tmp_path / "b", "fuse"), report).metrics
    assert m["fusion_check_passed"] == 0.0


def test_remedy_switches_off_the_riskiest_pattern():
    cfg = fuse.Config()
    nxt = fuse.remedy(cfg, Failure(kind="gate", reason="r", metric="fusion_exact_match"))
    assert "moe_grouped" not in nxt.patterns and len(nxt.patterns) == len(cfg.patterns) - 1
    assert fuse.remedy(cfg, Failure(kind="gate", reason="r", metric="throughput_tok_s")) is None
    assert fuse.remedy(fuse.Config(patterns=[]), Failure(kind="gate", reason="r", metric="fusion_cosine")) is None


GENERIC = """
import torch
from torch import nn


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return torch.cat((self.left(x), self.right(x)), -1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = Inner(), nn.Linear(12, 3)

    def forward(self, x):
        h = self.inner(x)
        return self.head(h if h.sum() > 0 else -h)


def build():
    torch.manual_seed(0)
    return Net()
"""


def test_generic_model_fuses_what_traces_and_ignores_the_rest(tmp_path):
    (tmp_path / "generic_model.py").write_text(GENERIC)
    pipeline = make_project(tmp_path, [{"id": "fuse", "uses": "fuse"}], model={"factory": "generic_model:build"})
    result = fuse.run(context(pipeline, tmp_path / "out", "fuse"), fuse.Config())
    assert result.metrics["fusion_exact_match"] == 1.0 and "ops_before" not in result.metrics
    report = json.loads((tmp_path / "out" / "artifacts" / "fusion.json").read_text())
    assert [i["module"] for i in report["ignored"]] == ["<root>"]
    assert "control flow" in report["ignored"][0]["reason"]  # the root branches on data
    assert report["patterns"]["linear_group"]["fused"] == 1  # left/right read one input: one GEMM
    assert "inner.left__right.weight" in dict(result.model.named_parameters())
