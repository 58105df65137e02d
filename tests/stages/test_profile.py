"""The ``profile`` stage through the runner: metrics, profile.json (drawn by the report), model unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from opus.models import DecoderLM, ModelConfig
from opus.pipeline.preflight import undeclared_metrics
from opus.report.plots import profile_shares
from opus.runtime.profiling import ROLES
from stages import profile as profile_stage
from tests.helpers import pipeline, run_cli, statuses, summary, write_pipeline


def tiny_moe(seed: int = 0) -> DecoderLM:
    """Factory source of the pipeline (``tests.stages.test_profile:tiny_moe``)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(family="mixtral", vocab_size=53, hidden_size=32, intermediate_size=32, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, moe_intermediate_size=32)
    return DecoderLM(cfg).eval()


def test_profile_stage_end_to_end(tmp_path: Path) -> None:
    spec = pipeline([{"id": "profile", "uses": "profile", "with": {"batch_size": 2, "top": 5}}],
                    model={"factory": "tests.stages.test_profile:tiny_moe"},
                    workload={"batch_size": 8, "input_len": 8, "output_len": 4, "warmup": 0, "repeats": 1})
    run_dir = tmp_path / "run"
    assert run_cli("run", write_pipeline(tmp_path / "p.yaml", spec), "--run-dir", run_dir) == 0
    assert statuses(run_dir) == {"profile": "done"}
    (stage,) = summary(run_dir)["stages"]
    metrics = stage["metrics"]
    assert metrics["profile_prefill_ms"] > 0 and metrics["profile_decode_ms"] > 0
    assert metrics["profile_ops_prefill"] > 0 and metrics["profile_ops_decode"] > 0
    assert abs(sum(metrics[f"share_{r}"] for r in ROLES) - 1.0) < 1e-3
    assert metrics["share_experts"] > 0 and metrics["share_attention"] > 0
    assert not undeclared_metrics(profile_stage, metrics)  # what gates are checked against before a run

    artifacts = run_dir / "stages" / "00-profile" / "artifacts"
    profile = json.loads((artifacts / "profile.json").read_text())
    assert profile["workload"]["batch_size"] == 2 and profile["workload"]["input_len"] == 8  # stage override
    assert profile["decode"]["cache_len"] == 8 and len(profile["hotspots"]) == 5
    assert not (artifacts / "profile.png").exists()  # plots are the report's, not the stage's
    assert profile_shares(profile).startswith(b"\x89PNG")
    # A measuring stage passes the model through: its checkpoint holds no tensors of its own.
    state = json.loads((run_dir / "stages" / "00-profile" / "state.json").read_text())
    assert state["recipe"] == [] and not state.get("tensors")
