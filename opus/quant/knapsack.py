"""The mixed-precision planner: the fastest assignment of formats to groups within a budget.

Each group picks one format (a multiple-choice knapsack solved exactly by dynamic programming over a
discretized budget). Value: measured kernel time saved over the workload against the float layer,
each format's time as ``opus.runtime.timed_choice.credible`` counts it: a format within the noise margin of a more
accurate one counts as no faster than it, so the knapsack takes the less accurate one only where
it is faster beyond the noise (or the more accurate one does not fit the budget).
Cost: predicted Δ cross-entropy (budget ``ppl``), weight bytes (``memory``) or weight bits
(``bits``). A format slower than float is never chosen unless a rule forces it; the plan says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opus.quant.formats import is_noop

BINS = 2000


@dataclass
class Candidate:
    fmt: str
    time_ms: float  # as the solver counts it (see the module docstring)
    cost: float  # in the budget's unit
    dce: float | None = None
    kl: float | None = None
    measured_ms: float | None = None  # the median measured, where it differs from time_ms
    how: str | None = None  # how dce and kl were obtained (opus.quant.sensitivity.Scoring.describe)
    where: str | None = None  # the cluster worker that scored it (None: the stage's own process)

    @property
    def measured(self) -> float:
        return self.time_ms if self.measured_ms is None else self.measured_ms


@dataclass
class GroupChoice:
    name: str
    role: str
    modules: list[str]
    float_ms: float
    candidates: list[Candidate]
    forced: str | None = None
    params: int = 0
    notes: list[str] = field(default_factory=list)
    margin: float | None = None  # the noise margin of its kernel timings (opus.runtime.timed_choice)


def budget_limit(kind: str, value: float, total_params: int) -> float:
    """The budget in cost units: ln(1 + Δppl) for ppl, bytes for memory, total bits for bits."""
    if kind == "ppl":
        return math.log1p(value)
    if kind == "memory":
        return value * 2**20
    return value * total_params


def solve(groups: list[GroupChoice], limit: float) -> dict[str, Candidate]:
    """Maximize total time saved subject to Σ cost ≤ limit; forced groups take their format."""
    fixed = {g.name: next(c for c in g.candidates if c.fmt == g.forced) for g in groups if g.forced}
    free = [g for g in groups if not g.forced]
    remaining = limit - sum(c.cost for c in fixed.values())
    if remaining < 0:
        raise ValueError("the forced formats alone exceed the budget")
    scale = BINS / remaining if remaining > 0 else 0.0
    dp = np.full(BINS + 1, -np.inf)
    dp[0] = 0.0
    choices = []
    for group in free:
        new = np.full(BINS + 1, -np.inf)
        pick = np.full(BINS + 1, -1)
        for index, cand in enumerate(group.candidates):
            units = int(math.ceil(max(cand.cost, 0.0) * scale - 1e-9)) if scale else (0 if cand.cost <= 0 else BINS + 1)
            if units > BINS:
                continue
            shifted = np.full(BINS + 1, -np.inf)
            shifted[units:] = dp[: BINS + 1 - units] + (group.float_ms - cand.time_ms)
            better = shifted > new
            new[better], pick[better] = shifted[better], index
        dp = new
        choices.append(pick)
    best = int(np.argmax(dp))
    if not np.isfinite(dp[best]):
        raise ValueError("no assignment fits the budget (is float among the candidates?)")
    chosen = dict(fixed)
    for group, pick in zip(reversed(free), reversed(choices)):
        cand = group.candidates[int(pick[best])]
        chosen[group.name] = cand
        units = int(math.ceil(max(cand.cost, 0.0) * scale - 1e-9)) if scale else 0
        best -= units
    return chosen


def explain(group: GroupChoice, chosen: Candidate, kind: str) -> str:
    float_ms = group.float_ms
    if group.forced:
        return f"forced to {chosen.fmt} by a rule"
    speed = f"{float_ms / chosen.time_ms:.2f}× the float layer's speed" if chosen.time_ms > 0 else ""
    slower = [c.fmt for c in group.candidates if c.measured > float_ms and not is_noop(c.fmt)]
    tail = f"; slower than float here: {', '.join(slower)}" if slower else ""
    # measured faster, counted no faster: within the noise margin of a more accurate format
    tied = [c.fmt for c in group.candidates if c.measured < chosen.measured and c.time_ms >= chosen.time_ms]
    if tied and group.margin is not None:
        tail += f"; within the {group.margin:.1%} noise margin, so no faster: {', '.join(tied)}"
    if is_noop(chosen.fmt):
        return "kept float: no faster format fits the budget" + tail
    faster = [c for c in group.candidates if c.time_ms < chosen.time_ms]
    why = "the fastest format" if not faster else f"fastest within the {kind} budget"
    return f"{why}: {speed}" + (f", Δce {chosen.dce:.5f}" if chosen.dce is not None else "") + tail


def _scored_by(candidates: list[Candidate]) -> dict[str, Any]:
    """How the group's scores were obtained, and where when on a cluster: one line when all agree
    (they usually do), else per format."""
    out: dict[str, Any] = {}
    for key, attr in (("scored_by", "how"), ("scored_on", "where")):
        found = {c.fmt: getattr(c, attr) for c in candidates if getattr(c, attr)}
        if found:
            out[key] = next(iter(found.values())) if len(set(found.values())) == 1 else found
    return out


def plan_document(groups: list[GroupChoice], chosen: dict[str, Candidate], budget: dict[str, Any],
                  limit: float) -> dict[str, Any]:
    float_total = sum(g.float_ms for g in groups)
    planned = sum(chosen[g.name].measured for g in groups)
    dce = sum(chosen[g.name].dce or 0.0 for g in groups)
    entries = []
    for g in sorted(groups, key=lambda g: g.name):
        c = chosen[g.name]
        entries.append({
            "name": g.name, "role": g.role, "format": c.fmt, "modules": g.modules,
            "score": {x.fmt: round(x.dce, 6) for x in g.candidates if x.dce is not None},
            "kl": {x.fmt: round(x.kl, 6) for x in g.candidates if x.kl is not None},
            **_scored_by(g.candidates),
            "time_ms": {x.fmt: round(x.measured, 4) for x in g.candidates},
            **({"margin": round(g.margin, 4)} if g.margin is not None else {}),
            "reason": explain(g, c, budget["kind"]), **({"notes": g.notes} if g.notes else {}),
        })
    return {
        "version": 1,
        "budget": budget,
        "predicted": {"ppl_increase": round(math.expm1(dce), 5), "linear_ms_float": round(float_total, 3),
                      "linear_ms_planned": round(planned, 3),
                      "linear_speedup": round(float_total / planned, 3) if planned else None},
        "groups": entries,
    }
