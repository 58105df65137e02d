"""The plan stage's scoring methods side by side: sweep time, agreement of the scores, and the plan's perplexity.

For each method (``suffix``, the default; ``taylor``, the one-backward-pass proxy; optionally ``full``)
this makes the plan as the plan stage makes it (the pipeline's plan config; no end-to-end check, so
that the plans differ only by their scores: every method reuses the kernel timings the first one
measured), quantizes a fresh float copy with it (real kernels) and measures perplexity on the
pipeline's evaluation text. It prints per method: the sweep's seconds, the rank agreement of its unit
scores with the first method's (Spearman), the ratio of their sums, groups per format, the predicted
and the measured perplexity increase. A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/sensitivity_proxy.py pipelines/k3.yaml [--methods suffix,taylor,full]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # stages/ is not installed

from opus.pipeline.spec import load_pipeline  # noqa: E402
from opus.pipeline.state import load_base  # noqa: E402
from opus.quant.apply import quantize_model  # noqa: E402
from opus.quant.calibrate import collect_stats  # noqa: E402
from opus.quant.plan import PlanRequest, make_plan  # noqa: E402
from opus.quant.plan_file import PlanDocument  # noqa: E402
from opus.quant.sensitivity import Scoring  # noqa: E402
from opus.runtime.data import load_blocks  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402
from opus.runtime.metrics import evaluate_lm  # noqa: E402
from stages.plan import Config as PlanConfig  # noqa: E402


def unit_scores(doc: PlanDocument) -> dict[tuple[str, str], float]:
    return {(g.name, fmt): value for g in doc.groups for fmt, value in g.score.items()}


def spearman(a: list[float], b: list[float]) -> float:
    rank = lambda values: torch.tensor(values).argsort().argsort().float()  # noqa: E731
    return float(torch.corrcoef(torch.stack([rank(a), rank(b)]))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", type=Path)
    parser.add_argument("--methods", default="suffix,taylor")
    args = parser.parse_args()
    loaded = load_pipeline(args.pipeline)
    spec, base_dir = loaded.spec, args.pipeline.parent
    stage = next(s for s in spec.stages if s.uses == "plan")
    cfg = PlanConfig(**stage.with_)
    float_model, tokenizer = load_base(spec, base_dir)
    calibration = load_blocks(spec.data.calibration or spec.data.evaluation, tokenizer, base_dir)
    evaluation = load_blocks(spec.data.evaluation or spec.data.calibration, tokenizer, base_dir)
    stats = collect_stats(float_model, calibration, percentile=cfg.percentile)
    with torch.inference_mode():
        base_ppl = evaluate_lm(float_model, evaluation)["perplexity"]
    timings: dict[str, dict[str, list[float]]] = {}
    rows, first = [], None
    record: dict[str, Any] = {}
    with recorded(record):
        for method in args.methods.split(","):
            model, _ = load_base(spec, base_dir)
            kind, value = cfg.budget.kind_value()
            request = PlanRequest(list(cfg.formats), cfg.include, cfg.exclude, cfg.force, kind, value, cfg.safety,
                                  cfg.group_size, False, cfg.rounds, Scoring(method, cfg.sensitivity.top_k),
                                  timings=timings)
            started = time.monotonic()
            doc, _ = make_plan(model, calibration, stats, request, spec.workload)
            plan_s = time.monotonic() - started
            del model  # smoothed in place: quantize a fresh float copy, as the quantize stage does
            model, _ = load_base(spec, base_dir)
            quantize_model(model, doc.assignment(), stats, group_size=cfg.group_size)
            with torch.inference_mode():
                ppl = evaluate_lm(model, evaluation)["perplexity"]
            scores = unit_scores(doc)
            first = first or (method, scores, doc)
            common = [k for k in first[1] if k in scores]
            counts = doc.format_counts()
            same = [g.format for g in doc.groups] == [g.format for g in first[2].groups]
            rows.append((method, (doc.sensitivity or {}).get("seconds"), plan_s,
                         spearman([first[1][k] for k in common], [scores[k] for k in common]),
                         sum(scores[k] for k in common) / sum(first[1][k] for k in common), counts, same,
                         doc.predicted.ppl_increase, ppl / base_ppl - 1))
            print(f"{method}: sweep {rows[-1][1]} s, measured perplexity {ppl:.3f}", flush=True)
    print(f"\n{describe(record['machine'])}")
    print(f"{args.pipeline}: float perplexity {base_ppl:.3f}; kernel timings measured once, shared by every plan")
    print(f"{'method':<8} {'sweep s':>8} {'plan s':>7} {'spearman':>9} {'sum ×':>6}  {'same plan':>9}  "
          f"{'pred Δppl':>9} {'meas Δppl':>9}  groups")
    for method, sweep_s, plan_s, rho, ratio, counts, same, predicted, measured in rows:
        print(f"{method:<8} {sweep_s:>8.1f} {plan_s:>7.1f} {rho:>9.3f} {ratio:>6.2f}  {'yes' if same else 'no':>9}  "
              f"{predicted:>+9.2%} {measured:>+9.2%}  " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    print(f"(spearman, sum × and same plan: against {first[0]}, over the units both scored)")


if __name__ == "__main__":
    main()
