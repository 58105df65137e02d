"""From a model and calibration text to a plan document: the mechanism behind the ``plan`` stage."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from opus.quant.calibrate import ActivationStats
from opus.quant.formats import FORMATS, check_format, is_noop, ladder, noop_name
from opus.quant.groups import QGroup, build_groups, matches
from opus.quant.knapsack import Candidate, GroupChoice, budget_limit, plan_document, solve
from opus.quant.plan_file import PlanDocument
from opus.quant.sensitivity import Scoring, Tally, UnitCache, measure_sensitivity, scores_smoothed_in_one_pass
from opus.quant.smooth import choose_factors, fold_factors, input_scales, smooth_groups
from opus.quant.speed import KernelTimer, group_rounds_ms
from opus.quant.validate import PLAN, Prepare, check_end_to_end
from opus.runtime.timed_choice import DEFAULT_ROUNDS, Decision, Option, credible, decide_from

Progress = Callable[[float, float, str], None]


@dataclass
class PlanRequest:
    formats: list[str]
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    force: dict[str, str] = field(default_factory=dict)
    budget_kind: str = "ppl"
    budget_value: float = 0.02
    safety: float = 0.7
    group_size: int = 128
    validate: bool = False  # time the plan and the uniform alternatives end to end (opus.quant.validate)
    rounds: int = DEFAULT_ROUNDS  # interleaved timing rounds per decision (opus.runtime.timed_choice)
    scoring: Scoring = field(default_factory=Scoring)  # how each (group, format) is scored
    units: UnitCache | None = None  # finished sensitivity units, reused across attempts
    # Opens a pool of cluster workers for the sweep (opus.cluster.ray_pool.ray_pool), closed before any
    # timing so that nothing else runs on the machine while kernels are timed; None: this process.
    cluster: Callable[[], AbstractContextManager[Any]] | None = None
    # Kernel timings by group, filled as they are measured and reused where present: two plans made with
    # one dict differ only by their scores (a comparison of scoring methods holds the timings fixed).
    timings: dict[str, dict[str, list[float]]] | None = None
    # How the end-to-end check readies each contender to run (opus.quant.validate.Prepare; None: as it is,
    # in the growing cache), and what to call that in the report.
    check_prepare: Prepare | None = None
    check_runtime: str = "eager"
    # The model will run compiled: layers with a pure kernel are timed through inductor too (opus.quant.speed).
    compiled_kernels: bool = False


def usable_formats(formats: list[str], device: str, notes: list[str]) -> list[str]:
    usable = []
    for fmt in formats:
        try:
            check_format(fmt, device)
            usable.append(fmt)
        except ValueError as exc:
            notes.append(f"{fmt} not considered: {exc}")
    return usable


def _forced(group: QGroup, force: dict[str, str]) -> str | None:
    for pattern, fmt in force.items():
        if any(matches(m, [pattern]) for m in group.modules):
            return fmt
    return None


def _cost(kind: str, fmt: str, params: int, dce: float | None) -> float:
    if kind == "ppl":
        return 0.0 if is_noop(fmt) else max(dce or 0.0, 0.0)
    bits = FORMATS[fmt].weight_bits
    return params * bits / 8 if kind == "memory" else params * bits


def make_plan(model: nn.Module, blocks: torch.Tensor, stats: ActivationStats, request: PlanRequest,
              workload: Any, progress: Progress | None = None) -> tuple[PlanDocument, list[Decision]]:
    """Score every group in every format, time the kernels, solve the budget, explain each choice.

    Returns the plan document and the timing decisions behind it (one per group, and the end-to-end
    check's), for ``decisions.json``."""
    device = str(next(model.parameters()).device)
    dtype = next(model.parameters()).dtype
    notes: list[str] = []
    formats = usable_formats(request.formats, device, notes)
    # A tied lm_head quantized to int8 per row serves the embedding too (the quantize stage shares it,
    # opus.quant.tied); in another format it costs memory (its own copy). Planned under a perplexity
    # budget only either way: the head's accuracy is the whole vocabulary's.
    # Compiled, the model runs fused, and the fuse stage groups a MoE layer's experts only where their gate/up
    # and down share a format: otherwise they run one by one (on K3 a plan of W8A8 gate/up and fp32 down ran
    # 2,162 ms a batch against 1,229 for uniform W8A8). So there a layer's experts are one group.
    groups = build_groups(model, request.include, request.exclude, tied=request.budget_kind == "ppl",
                          whole_experts=request.compiled_kernels)
    forced = {g.name: _forced(g, request.force) for g in groups}
    free = [g for g in groups if not forced[g.name]]
    pristine = copy.deepcopy(model) if request.validate else None  # before smoothing, below, changes it
    plain = [f for f in formats if not FORMATS[f].acts_quantized]
    act = [f for f in formats if FORMATS[f].acts_quantized]
    total = len(free) * len(formats)
    tally = Tally(request.units)
    sweep_started = time.monotonic()
    with request.cluster() if request.cluster else nullcontext() as pool:
        sweep = dict(group_size=request.group_size, scoring=request.scoring, units=tally, progress=progress,
                     total=total, pool=pool)
        # Activation formats are scored as they will run: after SmoothQuant (exact in float); the Taylor
        # proxy scores them beside the plain ones from the factors, the other methods on the smoothed model.
        factors = choose_factors(model, stats, smooth_groups(model)) if act else []
        one_pass = bool(act) and scores_smoothed_in_one_pass(model, request.scoring)
        scores = measure_sensitivity(model, free, plain + act if one_pass else plain, blocks,
                                     input_scales=input_scales(factors) if one_pass else None, **sweep)
        fold_factors(model, factors)
        if act and not one_pass:
            more = measure_sensitivity(model, free, act, blocks, done=len(free) * len(plain), **sweep)
            for name, by_fmt in more.items():
                scores.setdefault(name, {}).update(by_fmt)
    sweep_s = time.monotonic() - sweep_started  # a cluster's start-up and hand-back included
    cfg = getattr(model, "config", None)
    experts, top_k = getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "top_k", 0) or 0
    timer = KernelTimer(device, dtype, request.group_size, request.rounds, request.compiled_kernels)
    choices, decisions = [], []
    for index, group in enumerate(groups):
        linears = [model.get_submodule(m) for m in group.modules]
        force = forced[group.name]
        timeable = _timeable(group, linears, force, formats, scores.get(group.name, {}), request.group_size, notes)
        samples = (request.timings or {}).get(group.name)
        if samples is None or set(samples) != set(timeable):
            samples = group_rounds_ms(timer, timeable, group.modules, linears, group.role, workload, experts, top_k,
                                      dense_decode=request.compiled_kernels)
            if request.timings is not None:
                request.timings[group.name] = samples
        choice, decision = _group_choice(group, linears, force, samples, scores.get(group.name, {}),
                                         request.budget_kind)
        choices.append(choice)
        decisions.append(decision)
        if progress:
            progress(index + 1, len(groups), f"kernel timing {group.name}")
    total_params = sum(c.params for c in choices)
    value = request.budget_value * (request.safety if request.budget_kind == "ppl" else 1.0)
    limit = budget_limit(request.budget_kind, value, total_params)
    chosen = solve(choices, limit)
    report = None
    if pristine is not None:
        chosen, report, more, checked = check_end_to_end(pristine, choices, chosen, formats, limit, stats,
                                                         request.group_size, workload, blocks, progress,
                                                         rounds=request.rounds, prepare=request.check_prepare,
                                                         runtime=request.check_runtime)
        notes.extend(more)
        decisions += [checked] if checked else []
    for choice, decision in zip(choices, decisions):  # the pick alone is not the plan: budget, rules, check
        if chosen[choice.name].fmt != decision.winner:
            decision.reason += f"; the plan has {chosen[choice.name].fmt} (its reason is in plan.yaml)"
    budget = {"kind": request.budget_kind, "value": request.budget_value, "safety": request.safety}
    doc = plan_document(choices, chosen, budget, limit)
    if report:
        doc["measured"] = report
        if report["kept"] != PLAN:
            for entry in doc["groups"]:
                if not entry["reason"].startswith("forced"):
                    entry["reason"] = (f"{report['kept']} kept by the end-to-end check; "
                                       f"kernel view: {entry['reason']}")
    doc["notes"] = notes
    doc["group_size"] = request.group_size
    top_k = request.scoring.top_k if request.scoring.method == "suffix" else None  # full: the whole vocabulary
    doc["sensitivity"] = {"method": request.scoring.method, "top_k": top_k, "units": total,
                          "measured": tally.measured, "reused": tally.reused, "ran_on": _ran_on(scores),
                          "seconds": round(sweep_s, 1)}
    return PlanDocument.model_validate(doc), decisions


def _ran_on(scores: dict[str, dict[str, Any]]) -> dict[str, int]:
    """How many units ran where (a reused unit counts where it ran first); "this process" when local."""
    out: dict[str, int] = {}
    for by_fmt in scores.values():
        for score in by_fmt.values():
            where = score.get("where", "this process")
            out[where] = out.get(where, 0) + 1
    return dict(sorted(out.items()))


def _timeable(group: QGroup, linears: list[nn.Linear], force: str | None, formats: list[str],
              scores: dict[str, Any], group_size: int, notes: list[str]) -> list[str]:
    """The formats to time for a group: float, and those scored whose kernel takes every layer."""
    out = []
    base = noop_name()  # the float layer: always timed, the baseline every format must beat
    for fmt in dict.fromkeys([base, force] if force else [base, *formats]):
        reason = next(filter(None, (FORMATS[fmt].unsupported(lin, group_size) for lin in linears)), None)
        if reason:
            if fmt == force:
                raise ValueError(f"rule forces {group.name} to {fmt}, but {reason}")
            notes.append(f"{group.name}: {fmt} not possible: {reason}")
        elif fmt in (base, force) or fmt in scores:
            out.append(fmt)
    return out


def _group_choice(group: QGroup, linears: list[nn.Linear], force: str | None, samples: dict[str, list[float]],
                  scores: dict[str, Any], budget_kind: str) -> tuple[GroupChoice, Decision]:
    """The group's candidates, each timed as the shared rule counts it (opus.runtime.timed_choice.credible)."""
    params = sum(lin.weight.numel() for lin in linears)
    dce = {fmt: scores.get(fmt, {}).get("dce") for fmt in samples}
    # Between formats as accurate as each other, the one higher up the accuracy ladder is the simpler.
    simplicity = {fmt: rank for rank, fmt in enumerate(reversed(ladder()))}
    options = [Option(fmt, error=max(dce[fmt] or 0.0, 0.0), simplicity=simplicity[fmt]) for fmt in samples]
    decision = decide_from(f"kernel formats: {group.name}", options, samples, unit="ms")
    counted = credible(decision)
    candidates = [Candidate(fmt, counted[fmt], _cost(budget_kind, fmt, params, dce[fmt]), dce[fmt],
                            scores.get(fmt, {}).get("kl"), measured_ms=decision.medians[fmt],
                            how=scores.get(fmt, {}).get("how"), where=scores.get(fmt, {}).get("where"))
                  for fmt in samples]
    choice = GroupChoice(group.name, group.role, group.modules, decision.medians[noop_name()], candidates, force,
                         params, margin=decision.margin)
    return choice, decision
