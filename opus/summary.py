"""``summary.json``: the run's verdict, baseline and final measures, stages and rollbacks."""

from __future__ import annotations

from typing import Any

MEASURES = ("throughput_tok_s", "ttft_ms", "perplexity", "peak_mem_mb")
FINAL_EXTRA = ("agreement", "logits_cosine", "top5_overlap", "top1_accuracy")
KEPT = {"done", "cached"}


def _pick(metrics: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: metrics.get(k) for k in keys}


def build_summary(run_id: str, status: str, records: list[dict[str, Any]],
                  rollbacks: list[dict[str, Any]], error: str | None = None) -> dict[str, Any]:
    baseline = next((r["metrics"] for r in records if r.get("baseline")), {})
    measured = [r for r in records if r["status"] in KEPT and not r.get("baseline")
                and any(k in r["metrics"] for k in MEASURES)]
    final_metrics = measured[-1]["metrics"] if measured else baseline
    final = _pick(final_metrics, MEASURES + FINAL_EXTRA)
    ratios = {}
    for key in MEASURES:
        new, old = final.get(key), baseline.get(key)
        if isinstance(new, (int, float)) and isinstance(old, (int, float)) and old:
            ratios[key] = round(new / old, 4)
    return {
        "run_id": run_id,
        "status": status,
        "error": error,
        "baseline": _pick(baseline, MEASURES + ("top1_accuracy",)),
        "final": final,
        "final_stage": measured[-1]["id"] if measured else None,
        "ratios": ratios,
        "stages": records,
        "rollbacks": rollbacks,
    }
