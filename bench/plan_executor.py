"""The plan stage run alone, here and on a local Ray cluster with 1 and 2 workers: wall times and the same plan.

Each variant is the pipeline's plan stage (its own config; nothing before it) in a fresh run directory,
started as a user starts it (``opus run``), one after another on the same machine and cores:

- ``local``: the sweep in the stage's own process (``run.threads`` threads, default all cores);
- ``ray ×1``: one worker with every core (``num_cpus_per_task`` = cores, ``max_concurrency`` 1);
- ``ray ×2``: two workers with half the cores each.

It prints each variant's stage wall time and sweep time (plan.yaml ``sensitivity.seconds``, Ray's
start-up included) with its ratio to ``local`` measured in this run, and compares every variant's plan with
the local one: the scores (what Ray computes: they should agree to float tolerance) and the assignment
(which also rests on kernel timings and the end-to-end check, measured afresh in each run, so a tie
can break the other way; where it differs the table says which check kept what). A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_executor.py pipelines/k3.yaml [--out DIR] [--skip local]
    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_executor.py --llama-135m DIR --workload 8,128,32 --samples 4

``--llama-135m DIR`` writes (once) a Llama with the 135M Llama-family shape (30 layers, hidden 576, 9
heads, 3 KV heads, MLP 1536, vocabulary 49152) and random weights with transformers' ``save_pretrained``,
the K3 tokenizer beside it, and plans it on the K3 calibration text: the shape sets the sweep's cost,
the weights are not trained (no real 135M model is reachable offline).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opus.runtime.machine import describe, recorded  # noqa: E402

K3 = ROOT / "pipelines" / "k3.yaml"


def variants(cores: int) -> dict[str, Any]:
    half = max(1, cores // 2)
    return {"local": "local",
            "ray ×1": {"ray": {"address": "local", "local_cpus": cores, "num_cpus_per_task": cores,
                               "max_concurrency": 1}},
            "ray ×2": {"ray": {"address": "local", "local_cpus": cores, "num_cpus_per_task": half,
                               "max_concurrency": 2}}}


def llama_135m(directory: Path) -> Path:
    """A 135M-shape Llama (random weights) saved by transformers, with the K3 tokenizer beside it."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ROOT / "examples/k3/model" / name).is_file():
            shutil.copy(ROOT / "examples/k3/model" / name, directory / name)
    return directory


def plan_only(source: Path, out: Path, executor: Any, model_dir: Path | None, workload: str | None,
              samples: int | None, method: str | None) -> Path:
    """The source pipeline with its plan stage alone (paths made absolute) and ``run.executor``."""
    spec = yaml.safe_load(source.read_text())
    base = source.parent.resolve()
    for kind in ("hf", "gguf"):
        if kind in spec["model"]:
            spec["model"][kind] = str((base / spec["model"][kind]).resolve())
    if model_dir is not None:
        spec["model"] = {"hf": str(model_dir.resolve()), "dtype": "float32", "device": "cpu"}
    for text_set in (spec.get("data") or {}).values():
        if text_set and text_set.get("files"):
            text_set["files"] = [str(base / f) for f in text_set["files"]]
    plan = next(s for s in spec["stages"] if s["uses"] == "plan")
    plan.pop("needs", None)
    if method:
        plan.setdefault("with", {}).setdefault("sensitivity", {})["method"] = method
    spec["stages"] = [plan]
    spec.setdefault("run", {})["executor"] = executor
    if samples:
        spec["data"]["calibration"]["samples"] = samples
    if workload:
        batch, input_len, output_len = (int(x) for x in workload.split(","))
        spec["workload"] = {**spec.get("workload", {}), "batch_size": batch, "input_len": input_len,
                            "output_len": output_len}
    spec["name"] = f"{spec['name']}-plan"
    path = out / "pipeline.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))
    return path


def run_variant(path: Path, run_dir: Path) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "opus.cli.main", "run", str(path), "--run-dir", str(run_dir),
                           "--quiet"], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{path}: opus run exited {done.returncode}: {done.stderr.strip()[-600:]}")
    plan = yaml.safe_load(next(run_dir.glob("artifacts/*/plan.yaml")).read_text())
    return {"wall_s": wall, "plan": plan}


def processes(ran_on: dict[str, int]) -> int:
    """Distinct processes among the sweep's places (a Taylor unit's place names every task's process)."""
    found = {p for where in ran_on for p in re.findall(r"\S+ pid \d+", where)}
    return len(found) or len(ran_on)  # "this process"


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The largest relative score difference, and whether the assignment is the same (why not, if not)."""
    worst = 0.0
    for x, y in zip(a["groups"], b["groups"]):
        for fmt, value in x.get("score", {}).items():
            other = y.get("score", {}).get(fmt, float("inf"))
            worst = max(worst, abs(other - value) / max(abs(value), 1e-6))
    differ = sum(x["format"] != y["format"] for x, y in zip(a["groups"], b["groups"]))
    if not differ:
        return f"scores within {worst:.1e}; same assignment"
    kept = (a.get("measured") or {}).get("kept"), (b.get("measured") or {}).get("kept")
    why = f" (end-to-end check kept {kept[1]}, locally {kept[0]})" if kept[0] != kept[1] else ""
    return f"scores within {worst:.1e}; {differ} groups differ{why}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", nargs="?", type=Path, default=K3)
    parser.add_argument("--llama-135m", type=Path, default=None, help="plan a 135M-shape Llama written here")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-plan-executor"))
    parser.add_argument("--workload", default=None, help="BATCH,INPUT,OUTPUT for the plan's timings (default: "
                        "the pipeline's)")
    parser.add_argument("--samples", type=int, default=None, help="calibration blocks (default: the pipeline's)")
    parser.add_argument("--method", default=None, help="the plan's sensitivity method (default: the pipeline's)")
    parser.add_argument("--skip", action="append", default=[], help="a variant not to run (local, 'ray ×1', ...)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    model_dir = llama_135m(args.llama_135m) if args.llama_135m else None
    results: dict[str, dict[str, Any]] = {}
    record: dict[str, Any] = {}
    with recorded(record):
        for index, (name, executor) in enumerate(variants(cores).items()):
            if name in args.skip:
                continue
            out = args.out / f"v{index}"
            path = plan_only(args.pipeline, out, executor, model_dir, args.workload, args.samples,
                             args.method)
            results[name] = run_variant(path, out / "run")
            sweep = results[name]["plan"]["sensitivity"]
            print(f"{name}: stage {results[name]['wall_s']:.1f} s, sweep {sweep['seconds']} s, "
                  f"{sweep['units']} units, ran on {processes(sweep['ran_on'])} process(es)", flush=True)
    print(f"\n{describe(record['machine'])}")
    print(f"model: {model_dir or args.pipeline}; calibration blocks: {args.samples or 'as the pipeline says'}; "
          f"workload: {args.workload or 'as the pipeline says'}; sensitivity: {args.method or 'as the pipeline says'}")
    reference = results.get("local")
    print(f"{'variant':<8} {'stage s':>8} {'sweep s':>8} {'sweep ×':>8}  against the local plan")
    for name, result in results.items():
        sweep = result["plan"]["sensitivity"]["seconds"]
        ratio = f"{reference['plan']['sensitivity']['seconds'] / sweep:.2f}" if reference else "-"
        verdict = compare(reference["plan"], result["plan"]) if reference else "-"
        print(f"{name:<8} {result['wall_s']:>8.1f} {sweep:>8.1f} {ratio:>8}  {verdict}")
    summary = {name: {"wall_s": r["wall_s"], "sensitivity": r["plan"]["sensitivity"]} for name, r in results.items()}
    (args.out / "results.json").write_text(json.dumps({"machine": record["machine"], "variants": summary}, indent=1))


if __name__ == "__main__":
    main()
