"""Gates: thresholds on any metric a stage reports, absolute or relative to this run's baseline.

A relative bound on a metric the stage also measured side by side with the baseline
(``<key>_paired``, opus.runtime.paired) is checked on that ratio's interval, at its conservative end.

``max_drop`` bounds an accuracy's fall from the baseline's on the same samples (the eval stage's
``tasks:``, opus.harness.compare): it passes when the drop's whole 95 % interval is within the bound,
fails when the whole interval is beyond it, and in between is *inconclusive*: the stage is kept (nothing
shows the bound broken), the check says so and the run's summary warns (more samples would decide).
``task_accuracy`` names every task's accuracy the stage reported (``task/<task>/acc``, else
``exact_match``).
"""

from __future__ import annotations

import math
from typing import Any

from opus.pipeline.contracts import GateCheck, GateVerdict
from opus.pipeline.spec import Threshold
from opus.runtime.noise import conservative_ratio, paired_key

# Short names users write in YAML -> the metric keys stages report.
ALIASES = {
    "throughput": "throughput_tok_s",
    "p": "throughput_tok_s",
    "ttft": "ttft_ms",
    "d": "ttft_ms",
    "memory": "peak_mem_mb",
    "ppl": "perplexity",
}

RELATIVE_BOUNDS = {"min_ratio", "max_ratio", "max_increase", "max_decrease"}
TASK_ACCURACY = "task_accuracy"

# Checked on every stage, gated or not: a NaN or infinite accuracy figure means a broken model,
# whatever the stage's own gate says (a gate on speed alone must not pass a model that outputs NaN).
ACCURACY_METRICS = ("perplexity", "top1_accuracy", "agreement", "agreement_free", "logits_cosine",
                    "top5_overlap")


def metric_key(name: str) -> str:
    return ALIASES.get(name.lower(), name)


def _passes(bound: str, limit: float, value: float, ratio: float | None) -> tuple[bool, float]:
    """Return (passed, the compared quantity) for one bound; ``ratio`` is the value over the baseline."""
    if bound == "min":
        return value >= limit, value
    if bound == "max":
        return value <= limit, value
    assert ratio is not None  # relative bounds are checked only with a baseline
    if bound == "min_ratio":
        return ratio >= limit, ratio
    if bound == "max_ratio":
        return ratio <= limit, ratio
    change = ratio - 1.0
    if bound == "max_increase":
        return change <= limit, change
    return -change <= limit, -change  # max_decrease


def task_accuracy_keys(metrics: dict[str, Any]) -> list[str]:
    """Each task's accuracy key (``acc``, else ``exact_match``): what ``task_accuracy`` names."""
    tasks: dict[str, list[str]] = {}
    for key in metrics:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "task" and parts[2] in ("acc", "exact_match"):
            tasks.setdefault(parts[1], []).append(parts[2])
    return [f"task/{task}/{'acc' if 'acc' in names else names[0]}" for task, names in sorted(tasks.items())]


def _keys(name: str, metrics: dict[str, Any]) -> list[str]:
    if name.lower() == TASK_ACCURACY:
        return task_accuracy_keys(metrics) or [TASK_ACCURACY]  # none: one check that says so
    return [metric_key(name)]


def _max_drop(check: dict[str, Any], key: str, limit: float, value: float, metrics: dict[str, Any],
              baseline: dict[str, Any] | None) -> None:
    """The drop from the baseline on the same samples: pass, fail or inconclusive on its interval."""
    drop = metrics.get(f"{key}_drop")
    base = metrics.get(f"{key}_base", (baseline or {}).get(key))
    check["baseline"] = base if isinstance(base, (int, float)) else None
    if not isinstance(drop, dict):
        if not isinstance(base, (int, float)):
            check.update(passed=False, reason=f"no baseline value of '{key}' in this run")
            return
        compared = float(base) - value
        check.update(passed=compared <= limit, compared=compared)
        if compared > limit:
            check["reason"] = f"{key} max_drop {limit}: dropped {compared:.4g}"
        return
    low, high = drop["low"], drop["high"]
    span = f"dropped {drop['drop']:+.3f}, 95% interval {low:+.3f} to {high:+.3f} over {drop['n']} samples"
    check.update(compared=drop["drop"], interval=(low, high), passed=low <= limit)
    if high <= limit:
        return
    if low > limit:
        check["reason"] = f"{key} max_drop {limit}: {span}"
    else:
        check.update(inconclusive=True, reason=f"{key} max_drop {limit}: inconclusive, {span}: more samples "
                                               "would tell whether it holds")


def check_gate(gate: dict[str, Threshold], metrics: dict[str, Any],
               baseline: dict[str, Any] | None) -> GateVerdict:
    """Evaluate every bound; the verdict lists each check with threshold, measured and baseline."""
    checks: list[dict[str, Any]] = []
    for name, threshold in gate.items():
        for key in _keys(name, metrics):
            checks += _check_metric(key, threshold, metrics, baseline)
    checks += _finite_checks(metrics, {c["metric"] for c in checks})
    typed = [GateCheck.model_validate(c) for c in checks]
    return GateVerdict(passed=all(c.passed for c in typed), checks=typed)


def _check_metric(key: str, threshold: Threshold, metrics: dict[str, Any],
                  baseline: dict[str, Any] | None) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    value = metrics.get(key)
    for bound, limit in threshold.model_dump(exclude_none=True).items():
        check = {"metric": key, "bound": bound, "threshold": limit, "measured": value}
        base = (baseline or {}).get(key)
        if bound in RELATIVE_BOUNDS:
            check["baseline"] = base
        if key == TASK_ACCURACY:
            check.update(passed=False, reason="the stage reported no task accuracy (the eval stage's `tasks:`)")
        elif not isinstance(value, (int, float)):
            check.update(passed=False, reason=f"the stage did not report '{key}'")
        elif not math.isfinite(value):
            check.update(passed=False, reason=f"{key} is {value} (not finite)")
        elif bound == "max_drop":
            _max_drop(check, key, float(limit), float(value), metrics, baseline)
        elif bound in RELATIVE_BOUNDS and not isinstance(base, (int, float)):
            check.update(passed=False, reason=f"no baseline value of '{key}' in this run")
        elif bound in RELATIVE_BOUNDS and isinstance(paired := metrics.get(paired_key(key)), dict):
            # Measured side by side with the baseline: the interval's conservative end decides.
            passed, compared = _passes(bound, float(limit), float(value), conservative_ratio(paired, bound))
            check.update(passed=passed, compared=compared, baseline=paired["baseline"],
                         interval=(paired["low"], paired["high"]))
            if not passed:
                check["reason"] = (f"{key} {bound} {limit}: measured {compared:.4g} (the conservative end of "
                                   f"the side-by-side ratio {paired['low']:.3g}–{paired['high']:.3g})")
        else:
            passed, compared = _passes(bound, float(limit), float(value),
                                       float(value) / base if base else float("inf"))
            check.update(passed=passed, compared=compared)
            if not passed:
                check["reason"] = f"{key} {bound} {limit}: measured {compared:.4g}"
        checks.append(check)
    return checks


def _finite_checks(metrics: dict[str, Any], gated: set[str]) -> list[dict[str, Any]]:
    """One check per reported accuracy metric not already gated: passed when it is a finite number."""
    out = []
    for key in ACCURACY_METRICS:
        value = metrics.get(key)
        if key in gated or not isinstance(value, (int, float)):
            continue
        check = {"metric": key, "bound": "finite", "threshold": None, "measured": value,
                 "passed": math.isfinite(value)}
        if not check["passed"]:
            check["reason"] = f"{key} is {value} (not finite): the model's output is broken"
        out.append(check)
    return out


def verified(verdict: GateVerdict | None) -> bool:
    """True when a verdict checked something and everything it checked passed."""
    return verdict is not None and verdict.verified
