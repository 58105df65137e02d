"""Quantization formats side by side on one model, in one run: P, D, memory, perplexity.

Variants: fp32 baseline; uniform W8A16, W4A16, naive W8A8 (per-tensor dynamic activations, no
smoothing), SmoothQuant W8A8 (per-token activations); and the planner's mixed plan within the
perplexity budget, made as the plan stage makes it (kernel timings, knapsack, then the end-to-end
check against the uniform formats). Uniform variants quantize every decoder linear (attention and
experts); the router stays fp32 and a tied lm_head stays with its embedding (the planner may give it
its own packed copy). Ratios are against the fp32 baseline
measured in the same run.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/quant_formats.py --batch 8 --input-len 256 --output-len 32
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opus.kv.cache import cache_factory  # noqa: E402
from opus.models import load_model  # noqa: E402
from opus.pipeline.spec import TextSetSpec, WorkloadSpec  # noqa: E402
from opus.quant.apply import quantize_model  # noqa: E402
from opus.quant.calibrate import collect_stats  # noqa: E402
from opus.quant.groups import ROUTER_PATTERNS, uniform_assignment  # noqa: E402
from opus.quant.plan import PlanRequest, assignment_from_plan, make_plan  # noqa: E402
from opus.runtime.data import load_blocks  # noqa: E402
from opus.runtime.metrics import Settings, measure_suite, prepare_inputs  # noqa: E402

ROUTERS = ROUTER_PATTERNS


def uniform(model: torch.nn.Module, fmt: str, group_size: int) -> dict[str, str]:
    return uniform_assignment(model, fmt, group_size)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/k3/model")
    parser.add_argument("--calib", default="examples/k3/data/calib/*.txt")
    parser.add_argument("--eval", default="examples/k3/data/heldout/*.txt")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.02, help="max perplexity increase")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()

    base, tokenizer = load_model({"hf": args.model}, ROOT)
    workload = WorkloadSpec(batch_size=args.batch, input_len=args.input_len, output_len=args.output_len,
                            warmup=1, repeats=args.repeats)
    calib = load_blocks(TextSetSpec(files=[args.calib], samples=16, seq_len=256), tokenizer, ROOT)
    evaluation = TextSetSpec(files=[args.eval], samples=args.eval_samples, seq_len=256)
    inputs = prepare_inputs(base, tokenizer, workload, evaluation, ROOT)
    stats = collect_stats(base, calib)
    started = time.monotonic()
    plan = make_plan(copy.deepcopy(base), calib, stats,
                     PlanRequest(["w8a8", "w8a16", "w4a16"], force={p: "fp32" for p in ROUTERS},
                                 budget_value=args.budget, group_size=args.group_size, validate=True),
                     workload)
    plan_s = time.monotonic() - started
    variants: list[tuple[str, dict[str, str] | None, bool]] = [
        ("fp32", None, False),
        ("w8a16", uniform(base, "w8a16", args.group_size), False),
        ("w4a16", uniform(base, "w4a16", args.group_size), False),
        ("w8a8 naive (per-tensor)", uniform(base, "w8a8_tensor", args.group_size), False),
        ("w8a8 SmoothQuant", uniform(base, "w8a8", args.group_size), True),
        ("planner mix", assignment_from_plan(plan), True),
    ]
    rows: list[dict[str, Any]] = []
    torch.set_grad_enabled(False)
    for name, assignment, smooth in variants:
        model = copy.deepcopy(base)
        if assignment:
            quantize_model(model, assignment, stats if smooth else None, group_size=args.group_size)
        metrics, _ = measure_suite(model, inputs, workload, Settings(), cache_factory(model))
        rows.append({"variant": name, **metrics})
        print(f"  measured {name}", file=sys.stderr, flush=True)
        del model
    base_row = rows[0]
    print(f"\nworkload: batch {args.batch}, input {args.input_len}, output {args.output_len}; "
          f"threads {torch.get_num_threads()}; plan made in {plan_s:.1f} s")
    print(f"{'variant':<26}{'P tok/s':>10}{'P ×':>7}{'D ms':>9}{'D ×':>7}{'dec b1':>9}{'model MB':>10}"
          f"{'peak MB':>9}{'ppl':>9}{'Δppl %':>8}  budget")
    for row in rows:
        dppl = (row["perplexity"] / base_row["perplexity"] - 1) * 100
        row["ppl_increase_pct"] = dppl
        row["within_budget"] = dppl <= args.budget * 100
        print(f"{row['variant']:<26}{row['throughput_tok_s']:>10.1f}"
              f"{row['throughput_tok_s'] / base_row['throughput_tok_s']:>7.2f}{row['ttft_ms']:>9.1f}"
              f"{row['ttft_ms'] / base_row['ttft_ms']:>7.2f}{row.get('decode_tok_s', 0):>9.1f}"
              f"{row['model_mb']:>10.1f}{row['peak_mem_mb']:>9.0f}{row['perplexity']:>9.3f}{dppl:>8.2f}"
              f"  {'ok' if row['within_budget'] else 'over'}")
    counts: dict[str, int] = {}
    for group in plan["groups"]:
        counts[group["format"]] = counts.get(group["format"], 0) + 1
    print(f"planner groups: {counts}; predicted Δppl {plan['predicted']['ppl_increase'] * 100:.2f} %")
    checked = plan["measured"]
    print(f"plan stage's end-to-end check (batch ms, kept: {checked['kept']}): "
          + ", ".join(f"{name} {row['batch_ms']:.0f}" for name, row in checked["contenders"].items()))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "plan": plan}, indent=2, default=str))


if __name__ == "__main__":
    main()
