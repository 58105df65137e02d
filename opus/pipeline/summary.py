"""``summary.json``: the run's verdict first, then baseline and final measures, stages and rollbacks."""

from __future__ import annotations

from typing import Any

from opus.pipeline.verdict import final_record, slowdown_warnings
from opus.runtime.noise import paired_key, spread_key

MEASURES = ("throughput_tok_s", "ttft_ms", "perplexity", "peak_mem_mb")
FINAL_EXTRA = ("agreement", "agreement_free", "logits_cosine", "top5_overlap", "top1_accuracy")


HEADLINE = (("throughput_tok_s", "P", "{:.1f} tok/s"), ("ttft_ms", "D", "{:.1f} ms"),
            ("perplexity", "ppl", "{:.3f}"), ("agreement", "agree", "{:.3f}"), ("agreement_free", "free", "{:.3f}"),
            ("serve_output_tok_s", "served", "{:.1f} tok/s"), ("serve_ttft_p99_ms", "TTFT p99", "{:.0f} ms"),
            ("serve_concurrency", "clients", "{:d}"))


def headline(metrics: dict[str, Any]) -> str:
    """A stage's measures in one line (``P 41.2 tok/s  D 88.0 ms  ppl 9.601``), as every display shows them."""
    parts = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in HEADLINE
             if isinstance(metrics.get(key), (int, float))]
    return "  ".join(parts)

def _pick(metrics: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    picked = {k: metrics.get(k) for k in keys}
    # The spreads travel with the figures so that compare and the report can tell noise from change.
    picked.update({spread_key(k): metrics[spread_key(k)] for k in keys if spread_key(k) in metrics})
    return picked


def _inconclusive(records: list[dict[str, Any]]) -> list[str]:
    """A gate check a kept stage passed only because its interval could not tell (opus.pipeline.gates)."""
    return [f"{r['id']}: {c['reason']}" for r in records if r["status"] in ("done", "cached")
            for c in (r.get("gate") or {}).get("checks", []) if c.get("inconclusive")]


def build_summary(run_id: str, status: str, records: list[dict[str, Any]], rollbacks: list[dict[str, Any]],
                  error: str | None = None, reasons: list[str] | None = None) -> dict[str, Any]:
    baseline = next((r["metrics"] for r in records if r.get("baseline") and r["status"] in ("done", "cached")), {})
    chosen = final_record(records) if status in ("finished", "degraded") else None
    final = _pick(chosen["metrics"], MEASURES + FINAL_EXTRA) if chosen else {}
    final.update({k: v for k, v in (chosen or {}).get("metrics", {}).items()
                  if k.startswith("task/") and isinstance(v, (int, float))})
    ratios, intervals = {}, {}
    for key in MEASURES:
        new, old = final.get(key), baseline.get(key)
        paired = chosen["metrics"].get(paired_key(key)) if chosen else None
        if isinstance(paired, dict):  # measured side by side: the ratio a run can stand behind
            ratios[key] = round(paired["ratio"], 4)
            intervals[key] = {k: paired[k] for k in ("low", "high", "n", "noisy", "method", "drift") if k in paired}
        elif isinstance(new, (int, float)) and isinstance(old, (int, float)) and old:
            ratios[key] = round(new / old, 4)
    return {
        "status": status,
        "run_id": run_id,
        "reasons": reasons or [],
        "warnings": (slowdown_warnings(baseline, final, intervals) if chosen else []) + [
            f"{r['id']}: {w}" for r in records if r["status"] in ("done", "cached") for w in r.get("warnings") or []]
            + _inconclusive(records),
        "error": error,
        "baseline": _pick(baseline, MEASURES + ("top1_accuracy",)),
        "final": final,
        "final_stage": chosen["id"] if chosen else None,
        "ratios": ratios,
        # Ratios measured side by side with the baseline in the final stage: [low, high] over paired rounds.
        "ratio_intervals": intervals,
        "stages": records,
        "rollbacks": rollbacks,
    }
