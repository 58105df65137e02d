"""The planner's mixed-precision plan beside the uniform formats, measured by ``opus bench`` in one run.

``opus bench PIPELINE`` has every uniform format as a contender (w8a16, w4a16, w8a8 SmoothQuant,
w8a8-tensor), but the planner's mix only as part of a finished run (the ``opus`` contender: the run's
final model, after fusion and the KV cache choice too). Making the plan as the plan stage makes it
takes that stage's settings and defaults, which live in ``stages/plan.py`` — and opus never imports
stages. This script adds one contender, ``plan``: the pipeline's plan stage config (its defaults
where the pipeline says nothing) on the pipeline's calibration text and workload — sensitivity,
kernel timings, budget, end-to-end check — then applied as the quantize stage applies it (its
``promote`` and ``alpha``), no fusion, growing KV cache. Everything else is ``opus bench``: the same
inputs, measurement, table and outputs.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/planned_mix.py pipelines/k3.yaml --batch 8 --input-len 256 \\
        --output-len 64 [--only w8a16,w4a16,w8a8,w8a8-tensor] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing Opus (stages/ is not installed)

from opus.bench.core import BenchContext, Built, Contender, Unavailable  # noqa: E402
from opus.kv.cache import cache_factory  # noqa: E402

UNIFORM = "w8a16,w4a16,w8a8,w8a8-tensor"


def _stage_config(ctx: BenchContext, uses: str, config: Any) -> tuple[Any, str]:
    """The pipeline's first ``uses`` stage config, validated by the stage's own Config class."""
    stage = next((s for s in ctx.spec.stages if s.uses == uses), None)
    if stage is None:
        return config(), f"no {uses} stage in the pipeline: its defaults"
    return config(**stage.with_), f"stage '{stage.id}'"


def planned(made: dict[str, Any]) -> Contender:
    """The ``plan`` contender; ``made`` receives the plan document (written beside the table with --out)."""

    def build(ctx: BenchContext) -> Built:
        from opus.quant.apply import quantize_model
        from opus.quant.calibrate import collect_stats
        from opus.quant.plan import PlanRequest, make_plan
        from opus.runtime.data import load_blocks
        from stages.plan import Config as PlanConfig
        from stages.quantize import Config as QuantizeConfig
        from stages.quantize import promoted_groups

        plan_cfg, plan_where = _stage_config(ctx, "plan", PlanConfig)
        quant_cfg, _ = _stage_config(ctx, "quantize", QuantizeConfig)
        text_set = ctx.spec.data.calibration or ctx.spec.data.evaluation
        if text_set is None:
            raise Unavailable("the plan stage needs data.calibration (or data.evaluation) text")
        # As stages/plan.py: statistics and the plan from the float model, at the pipeline's workload.
        model = ctx.load("float32")
        blocks = load_blocks(text_set, ctx.tokenizer, ctx.base_dir)
        stats = collect_stats(model, blocks, percentile=plan_cfg.percentile)
        kind, value = plan_cfg.budget.kind_value()
        request = PlanRequest(list(plan_cfg.formats), plan_cfg.include, plan_cfg.exclude, plan_cfg.force, kind,
                              value, plan_cfg.safety, plan_cfg.group_size, plan_cfg.end_to_end_check,
                              plan_cfg.rounds)
        started = time.monotonic()
        doc, _ = make_plan(model, blocks, stats, request, ctx.spec.workload)
        seconds = time.monotonic() - started
        del model  # make_plan smooths it in place: quantize starts from a fresh float copy, as the stage does
        # As stages/quantize.py: its promotions, then the plan with real kernels.
        changes = promoted_groups(doc, quant_cfg.promote)
        model = ctx.load("float32")
        quantize_model(model, doc.assignment(), stats, group_size=doc.group_size, alpha=quant_cfg.alpha)
        made["plan"] = doc
        counts = doc.format_counts()
        w = ctx.spec.workload
        notes = [f"plan made as the plan stage makes it ({plan_where}) in {seconds:.1f} s, kernels timed at the "
                 f"pipeline's workload {w.batch_size}×{w.input_len}→{w.output_len}; groups per format: "
                 + ", ".join(f"{k} {v}" for k, v in counts.items())]
        predicted = doc.predicted.ppl_increase
        if predicted is not None:
            notes.append(f"predicted perplexity increase {predicted * 100:+.2f} %")
        checked = doc.measured
        if checked:
            notes.append(f"end-to-end check kept {checked['kept']}: " + ", ".join(
                f"{name} {row['batch_ms']} ms" for name, row in checked["contenders"].items()) + " per batch")
        if changes:
            notes.append(f"quantize promoted {len(changes)} groups (its promote: {quant_cfg.promote})")
        return Built(model, cache_factory(model), notes)

    return Contender("plan", "the planner's mix (plan + quantize stages)", "torch", build)


def main(argv: list[str] | None = None) -> int:
    from opus.bench.display import BenchDisplay
    from opus.bench.output import emit
    from opus.bench.run import BenchRequest, run_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pipeline", type=Path, nargs="?", default=ROOT / "pipelines/k3.yaml")
    ap.add_argument("--only", default=UNIFORM, help=f"opus bench contenders beside it (default {UNIFORM}); "
                                                     "the fp32 baseline always runs")
    ap.add_argument("--batch", dest="batch_size", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--eval-samples", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--group-size", type=int, default=64, help="the w4a16 contender's group size")
    ap.add_argument("--format", choices=("md", "json"), default="md")
    ap.add_argument("--out", type=Path, help="write bench.md, bench.json, bench.png and plan.yaml here")
    args = ap.parse_args(argv)
    made: dict[str, Any] = {}
    only = [t.strip() for t in args.only.split(",") if t.strip()]
    request = BenchRequest(target=args.pipeline, only=only, batch_size=args.batch_size, input_len=args.input_len,
                           output_len=args.output_len, repeats=args.repeats, eval_samples=args.eval_samples,
                           threads=args.threads, group_size=args.group_size, extra=(planned(made),))
    with BenchDisplay() as display:
        report, rows = run_bench(request, display)
    plan = {"plan.yaml": made["plan"].to_yaml()} if "plan" in made else {}
    emit(report, rows, args.format, args.out, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
