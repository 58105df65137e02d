"""Temporary git repositories and hand-written run directories for the history, compare and report tests."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from opus.pipeline.summary import build_summary

GITIGNORE = "runs/*/stages/\nruns/*/rejected/\nruns/*/.lock\nruns/*/logs/\n*.safetensors\n"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def make_repo(path: Path) -> Path:
    """A repository on branch main with one commit (a.txt, b.txt, .gitignore)."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "Test")
    git(path, "config", "user.email", "test@example.com")
    git(path, "config", "commit.gpgsign", "false")
    (path / ".gitignore").write_text(GITIGNORE)
    (path / "a.txt").write_text("a\n")
    (path / "b.txt").write_text("b\n")
    git(path, "add", ".")
    git(path, "commit", "-q", "-m", "initial")
    return path


def fake_run(run_dir: Path, *, name: str = "demo", throughput: float = 150.0, ttft: float = 80.0,
             perplexity: float = 10.2, factor: float = 2.0, rollback: bool = False,
             artifacts: dict[str, Any] | None = None, spread: float | None = None) -> Path:
    """A finished run directory as the runner leaves it: baseline + a quantize stage + an eval stage.

    ``spread``: the timed metrics (P, D) record repeats from ``value - spread`` to ``value + spread``.
    """
    stages_dir = run_dir / "stages"
    records = []
    specs = [("base", "baseline", {"throughput_tok_s": 100.0, "ttft_ms": 100.0, "perplexity": 10.0,
                                   "peak_mem_mb": 500.0}, True),
             ("quant", "quantize", {"quantized_layers": 4}, False),
             ("eval", "eval", {"throughput_tok_s": throughput, "ttft_ms": ttft, "perplexity": perplexity,
                               "peak_mem_mb": 300.0, "agreement": 0.97}, False)]
    if spread is not None:
        for _, _, metrics, _ in specs:
            for key in ("throughput_tok_s", "ttft_ms"):
                if key in metrics:
                    value = metrics[key]
                    metrics[f"{key}_spread"] = {"min": value - spread, "median": value, "max": value + spread, "n": 3}
    t0 = time.time() - 100
    events = [{"time": t0, "event": "run_started"}]
    for index, (stage_id, uses, metrics, baseline) in enumerate(specs):
        path = stages_dir / f"{index:02d}-{stage_id}"
        (path / "artifacts").mkdir(parents=True)
        (path / "tensors.safetensors").write_bytes(b"not really tensors")
        (path / "manifest.json").write_text(json.dumps({"key": f"k{index}", "files": {
            "tensors.safetensors": "ab" * 32}}))
        for artifact, content in ((artifacts or {}).get(stage_id) or {}).items():
            text = content if isinstance(content, str) else json.dumps(content)
            (path / "artifacts" / artifact).write_text(text)
        gate = {"passed": True, "checks": [{"metric": "perplexity", "bound": "max_ratio", "threshold": 1.05,
                                            "measured": perplexity, "baseline": 10.0, "passed": True}]} \
            if stage_id == "eval" else None
        records.append({"id": stage_id, "uses": uses, "key": f"k{index}", "status": "done", "dir": str(path),
                        "metrics": metrics, "baseline": baseline, "gate": gate, "attempts": 1 + rollback,
                        "duration_s": 1.0, "note": ""})
        start = t0 + 10 * index
        if rollback and stage_id == "quant":
            events += [{"time": start, "event": "stage_started", "stage": stage_id, "attempt": 0},
                       {"time": start + 3, "event": "rollback", "stage": stage_id, "attempt": 0,
                        "reason": "perplexity max_ratio 1.05: measured 1.3", "action": "retry"}]
            start += 4
        events += [{"time": start, "event": "stage_started", "stage": stage_id, "attempt": int(rollback)},
                   {"time": start + 5, "event": "stage_done", "stage": stage_id}]
    rollbacks = [{"stage": "quant", "attempt": 0, "kind": "gate", "metric": "perplexity", "bound": "max_ratio",
                  "threshold": 1.05, "measured": 1.3, "baseline": 10.0,
                  "reason": "perplexity max_ratio 1.05: measured 1.3",
                  "remedy": {"protect": {"from": 0, "to": 2}}, "action": "retry", "restored": "00-base",
                  "evidence": "rejected/x"}] if rollback else []
    summary = build_summary(run_dir.name, "finished", records, rollbacks)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name, "name": name, "created": t0,
                                                  "host": "test", "starts": [t0]}))
    pipeline = {"name": name, "model": {"hf": "model"},
                "stages": [{"id": "base", "uses": "baseline"},
                           {"id": "quant", "uses": "quantize", "needs": ["base"], "with": {"factor": factor}},
                           {"id": "eval", "uses": "eval", "needs": ["quant"]}]}
    (run_dir / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events + [
        {"time": t0 + 60, "event": "run_finished"}]))
    return run_dir
