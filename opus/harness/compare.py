"""A harness task run on the unmodified model and on the candidate over the same samples, and the drop.

Per task and metric the eval stage reports ``task/<task>/<metric>`` (the candidate), ``..._base`` (the
unmodified model) and, for a 0/1 metric (acc, exact_match), ``..._drop``: the baseline's score minus the
candidate's with its 95 % interval. Both models answer the same samples, so the drop is the difference
of the discordant shares: ``worse`` samples the baseline got and the candidate did not, ``better`` the
reverse; the interval joins the two shares' Wilson intervals (Newcombe's square-and-add), so 100 samples
answered identically still leave about ±0.037. A gate's ``max_drop`` passes only when the interval's
high end is within it, fails when its low end is beyond it, and says "inconclusive" in between.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

Z95 = 1.959964


def task_manager(tasks: list[str | dict[str, Any]]) -> Any:
    """The harness's task index: its own tasks only when a task is named (indexing them takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=any(isinstance(t, str) for t in tasks))


def run_tasks(lm: Any, tasks: list[str | dict[str, Any]], limit: int | None, seed: int = 0,
              manager: Any = None) -> dict[str, dict[str, list[float]]]:
    """Per task, per metric, the per-sample scores in document order."""
    import datasets
    from lm_eval import simple_evaluate

    datasets.disable_progress_bars()
    results = simple_evaluate(model=lm, tasks=list(tasks), limit=limit, bootstrap_iters=0, log_samples=True,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, verbosity="ERROR",
                              task_manager=manager or task_manager(list(tasks)))
    scores: dict[str, dict[str, list[float]]] = {}
    for task, samples in (results or {}).get("samples", {}).items():
        per_metric = scores.setdefault(task, {})
        for sample in sorted(samples, key=lambda s: s["doc_id"]):
            for metric in sample["metrics"]:
                name = metric if sample.get("filter", "none") == "none" else f"{metric}_{sample['filter']}"
                value = sample.get(metric)
                if isinstance(value, numbers.Real):  # numpy's numbers too; a metric's (prediction, ref) pairs not
                    per_metric.setdefault(name, []).append(float(value))
    return scores


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_drop(base: list[float], candidate: list[float]) -> dict[str, Any]:
    """Baseline minus candidate on the same 0/1-scored samples, with its 95 % interval."""
    n = len(base)
    worse = sum(1 for b, c in zip(base, candidate) if b > c)
    better = sum(1 for b, c in zip(base, candidate) if c > b)
    p_worse, p_better = worse / n, better / n
    (lw, hw), (lb, hb) = wilson(worse, n), wilson(better, n)
    drop = p_worse - p_better
    return {"drop": drop, "low": drop - math.hypot(p_worse - lw, hb - p_better),
            "high": drop + math.hypot(hw - p_worse, p_better - lb), "n": n, "worse": worse, "better": better}


def compare_scores(base: dict[str, dict[str, list[float]]],
                   candidate: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """The eval stage's task metrics from the two models' per-sample scores."""
    metrics: dict[str, Any] = {}
    for task, per_metric in candidate.items():
        for metric, values in per_metric.items():
            key = f"task/{task}/{metric}"
            metrics[key] = sum(values) / len(values) if values else float("nan")
            reference = base.get(task, {}).get(metric)
            if reference is None or len(reference) != len(values) or not values:
                continue
            metrics[f"{key}_base"] = sum(reference) / len(reference)
            if all(v in (0.0, 1.0) for v in values + reference):
                metrics[f"{key}_drop"] = paired_drop(reference, values)
    return metrics
