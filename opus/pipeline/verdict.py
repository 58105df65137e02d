"""The run's verdict: a status that never claims more than what happened, and why.

- ``finished`` (exit 0): every stage is done or reused from a checkpoint.
- ``degraded`` (exit 4): stages were rolled back or skipped after failures, but a transformed model
  survived and every eval stage passed its gates.
- ``failed`` (exit 3): the baseline or an eval stage failed, no model-transforming stage survived,
  or a stage's policy ended the run (``on_fail: abort``, retries exhausted, a full disk).
- ``interrupted`` (exit 130): stopped by the user; ``opus resume`` continues.

A stage counts by its type's role (opus.pipeline.registry.ROLES). Also here: which stage's metrics are the
run's final ones (the gated eval's), and the warnings a person must read (a final model slower than
the baseline beyond the measured noise).
"""

from __future__ import annotations

from typing import Any

from opus.runtime.noise import as_range, overlap, spread_key

KEPT = {"done", "cached"}
STATUSES = ("finished", "degraded", "failed", "interrupted")
# Failures that can pass by themselves: a resume runs such a rolled-back stage again. A gate's
# verdict and bad input ("input") repeat, so their rollbacks are kept.
TRANSIENT_FAILURES = {"crash", "stalled", "timeout", "disk"}
# (metric, higher is better) for the slowdown warning.
SPEED = (("throughput_tok_s", True), ("ttft_ms", False))


def run_status(records: list[dict[str, Any]], stopped: str | None) -> tuple[str, list[str]]:
    """``(status, reasons)`` from the stage records (in run order) and how the loop ended.

    ``stopped`` is ``"interrupted"``, ``"failed"`` (a stage ended the run) or None.
    """
    if stopped == "interrupted":
        return "interrupted", ["stopped by the user; `opus resume` continues"]
    lost = [r for r in records if r["status"] not in KEPT]
    never_run = [r["id"] for r in lost if r["status"] == "skipped"]
    reasons = [f"stage '{r['id']}' {r['status'].replace('_', ' ')}" + (f": {r['note']}" if r.get("note") else "")
               for r in lost if r["status"] != "skipped"]
    if never_run:  # one line for all the stages the run never reached
        reasons.append(f"not run, the run ended before them: {', '.join(never_run)}")
    if stopped == "failed":
        return "failed", reasons
    failed_evals = [r["id"] for r in lost if r.get("role") in ("baseline", "eval")]
    if failed_evals:
        return "failed", [f"stage '{s}' did not pass, so nothing can be claimed about the model" for s in failed_evals]
    transforms = [r for r in records if r.get("role") == "transform"]
    if transforms and not any(r["status"] in KEPT for r in transforms):
        return "failed", ["no model-transforming stage survived: the model was not optimized", *reasons]
    return ("degraded", reasons) if lost else ("finished", [])


def final_record(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The stage whose metrics are the run's final ones: the last eval stage that passed, else the
    last non-baseline stage that measured and passed a gate of its own; never an unchecked one."""
    kept = [r for r in records if r["status"] in KEPT and not r.get("baseline") and r.get("metrics")]
    evals = [r for r in kept if r.get("role") == "eval"]
    if evals:
        return evals[-1]
    gated = [r for r in kept if (r.get("gate") or {}).get("checks")
             and any(k in r["metrics"] for k, _ in SPEED + (("perplexity", False),))]
    return gated[-1] if gated else None


def slowdown_warnings(baseline: dict[str, Any], final: dict[str, Any],
                      intervals: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """A final model slower than the baseline: measured side by side, when the whole interval of the
    paired ratio says slower; otherwise where the two stages' repeat ranges do not overlap."""
    warnings = []
    for key, higher_is_better in SPEED:
        span = (intervals or {}).get(key)
        if span is not None:
            if (span["high"] < 1) if higher_is_better else (span["low"] > 1):
                warnings.append(f"the final model is slower than the baseline measured side by side: {key} "
                                f"×{span['low']:.3f}–{span['high']:.3f} over {span['n']} paired rounds")
            continue
        old, new = baseline.get(key), final.get(key)
        if not (isinstance(old, (int, float)) and isinstance(new, (int, float)) and old):
            continue
        worse = new < old if higher_is_better else new > old
        noisy = overlap(as_range(baseline.get(spread_key(key))), as_range(final.get(spread_key(key))))
        if worse and noisy is not True:
            evidence = "beyond the measured noise" if noisy is False else "no spread measured to tell noise"
            warnings.append(f"the final model is slower than the baseline: {key} {old:.4g} → {new:.4g} "
                            f"(×{new / old:.3f}, {evidence})")
    return warnings
