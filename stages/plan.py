"""plan: the mixed-precision planner — each layer group's format, score and reason, in plan.yaml."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from opus.errors import InputError
from opus.fusion.ready_to_time import fused_and_compiled
from opus.pipeline.context import StageContext, StageResult
from opus.pipeline.replay import source_artifact
from opus.quant.calibrate import CALIBRATION_FILE, collect_stats
from opus.quant.formats import FORMATS, check_format, known
from opus.quant.plan import PlanRequest, make_plan
from opus.quant.plan_file import PLAN_FILE, PlanDocument, read_plan
from opus.quant.sensitivity import Scoring
from opus.quant.validate import check_runtime
from opus.runtime.data import load_blocks
from opus.runtime.timed_choice import DEFAULT_ROUNDS, Decision, replayed, write_decisions

VERSION = "1"
ROLE = "analysis"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = frozenset({"planned_groups", "groups_*", "predicted_ppl_increase", "predicted_linear_speedup"})


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_ppl_increase: float | None = Field(None, gt=0)
    max_weight_mb: float | None = Field(None, gt=0)
    max_avg_bits: float | None = Field(None, gt=0, le=32)

    @model_validator(mode="after")
    def _one(self) -> Budget:
        given = [k for k, v in self.model_dump().items() if v is not None]
        if len(given) > 1:
            raise ValueError("give one budget: max_ppl_increase, max_weight_mb or max_avg_bits")
        if not given:
            self.max_ppl_increase = 0.02
        return self

    def kind_value(self) -> tuple[str, float]:
        if self.max_weight_mb is not None:
            return "memory", self.max_weight_mb
        if self.max_avg_bits is not None:
            return "bits", self.max_avg_bits
        return "ppl", float(self.max_ppl_increase or 0.02)


class Sensitivity(BaseModel):
    """How each (group, format) trial is scored (opus.quant.sensitivity)."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["suffix", "full", "taylor"] = Field(
        "suffix", description="suffix: run only the layers from the group's first one, from cached hidden states; "
        "full: the whole model; taylor: a second-order proxy from one backward pass per batch (opus.quant.taylor)")
    top_k: int | None = Field(64, ge=1, description="suffix: score the reference's top-k tokens, the target and "
                              "the tail (null: the full vocabulary, as the full measure does)")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    formats: list[str] = Field(default_factory=lambda: ["w8a8", "w8a16", "w4a16"],
                               description="formats to consider (opus.quant.formats); float is always one")
    include: list[str] = Field(default_factory=list, description="module-name globs to plan (default: all)")
    exclude: list[str] = Field(default_factory=list, description="module-name globs kept float")
    force: dict[str, str] = Field(default_factory=lambda: {"*.mlp.gate": "fp32", "*shared_expert_gate": "fp32"})
    budget: Budget = Field(default_factory=Budget)
    safety: float = Field(0.7, gt=0, le=1, description="share of a ppl budget the prediction may use")
    percentile: float = Field(99.9, gt=50, le=100)
    group_size: int = Field(128, gt=0)
    end_to_end_check: bool = Field(True, description="time the plan and every uniform format within the budget on "
                           "the whole model and keep the fastest, a tie within the noise going to the more "
                           "accurate (holds another float copy of the model and one quantized copy per "
                           "contender while timing)")
    runtime: Literal["auto", "compiled", "eager"] = Field(
        "auto", description="how the model will run, which the kernel timings and the end-to-end check follow: "
        "compiled = fused (every fusion pattern, MoE experts compiled at prefill) with compiled steps in the "
        "static KV cache, as the fuse and kv_config stages can run it, the prefill compiled too where a kv_config "
        "stage of the pipeline may keep that (include_static_prefill) (kernels are timed "
        "eagerly and through inductor, each keeping the faster); eager = unfused, growing cache; auto = compiled "
        "where the static cache can run the model (an Opus decoder), else eager")
    plan_file: str | None = Field(None, description="a hand-edited plan.yaml to honour as is")
    sensitivity: Sensitivity = Field(default_factory=Sensitivity)
    rounds: int = Field(DEFAULT_ROUNDS, ge=1, description="interleaved timing rounds behind each choice "
                        "(kernel timing, end-to-end check); their spread sets the noise margin "
                        "(opus.runtime.timed_choice)")

    @field_validator("formats")
    @classmethod
    def _registered(cls, formats: list[str]) -> list[str]:
        """Names are checked against the format registry, so a newly registered format is accepted as is;
        the float no-op is not a choice to list (every group is always timed in it)."""
        allowed = known(plannable=True)
        unknown = [f for f in formats if f not in FORMATS or f not in allowed]
        if unknown:
            raise ValueError(f"unknown format {', '.join(map(repr, unknown))} (known: {', '.join(allowed)})")
        return formats


def preflight(cfg: Config, spec: Any) -> list[tuple[tuple[str, ...], str]]:
    """Formats this device cannot run (or unknown ones in ``force``) fail before anything runs, not in
    quantize after the planning is done. A ``plan_file``'s own formats are checked when it is read."""
    wanted = [] if cfg.plan_file else [(("formats",), name) for name in cfg.formats]
    wanted += [(("force", glob), name) for glob, name in cfg.force.items()]
    problems = []
    for key, name in wanted:
        try:
            check_format(name, spec.model.device)
        except ValueError as exc:
            problems.append((key, str(exc)))
    return problems


def _runtime_request(model: Any, runtime: str, spec: Any) -> dict[str, Any]:
    """The runtime the plan is made for, as PlanRequest takes it: how the end-to-end check readies a
    contender and its name, and whether kernels are timed compiled too."""
    try:
        used, why = check_runtime(model, runtime)
    except ValueError as exc:
        raise InputError(str(exc), key="runtime") from None
    if used != "compiled":
        return {"check_prepare": None, "check_runtime": why, "compiled_kernels": False}
    if not _may_compile_prefill(spec):
        return {"check_prepare": fused_and_compiled, "check_runtime": why, "compiled_kernels": True}
    return {"check_prepare": functools.partial(fused_and_compiled, compile_prefill=True),
            "check_runtime": f"{why}, prefill compiled", "compiled_kernels": True}


def _may_compile_prefill(spec: Any) -> bool:
    """Whether a kv_config stage of this pipeline may keep a compiled prefill (``include_static_prefill``).
    The check then times the contenders' prefill compiled: eagerly, W8A8 quantizes its activations in
    several passes that a compiled prefill fuses, and with the prefill left eager the formats' prefills tied
    on K3 (2026-12-06) and the plan kept its float experts. Its attention is torch's SDPA whatever kv_config
    races: the same in every contender, so it does not change their order, and Opus's blocked kernel
    unrolls its query blocks into a graph that took ~10 minutes a shape to compile at 30 layers."""
    from stages.kv_config import Config as KVConfig

    for stage in spec.stages:
        if stage.uses not in ("kv_config", "stages.kv_config"):
            continue
        try:
            if KVConfig.model_validate(stage.with_).include_static_prefill:
                return True
        except ValueError:  # that stage's own check reports it, by its key
            continue
    return False


def run(ctx: StageContext, cfg: Config) -> StageResult:
    loaded = ctx.load_model()
    model = loaded.model
    runtime = _runtime_request(model, cfg.runtime, ctx.spec)  # a model that cannot run compiled fails before any work
    text_set = ctx.spec.data.calibration or ctx.spec.data.evaluation
    if text_set is None:
        raise InputError("the plan stage needs data.calibration (or data.evaluation) text")
    blocks = load_blocks(text_set, loaded.tokenizer, ctx.base_dir)
    stats = collect_stats(model, blocks, percentile=cfg.percentile, progress=ctx.progress)
    stats.save(ctx.artifact_dir / CALIBRATION_FILE)
    replay = source_artifact(ctx, PLAN_FILE)  # run.decisions_from: that run's plan, not timed again
    decisions: list[Decision] = []
    if replay is not None:
        doc = _user_plan(replay, model, f"replayed from {replay}")
        decisions.append(replayed("plan", PLAN_FILE, str(replay)))
    elif cfg.plan_file:
        doc = _user_plan(ctx.base_dir / cfg.plan_file, model)
    else:
        kind, value = cfg.budget.kind_value()
        request = PlanRequest(list(cfg.formats), cfg.include, cfg.exclude, cfg.force, kind, value, cfg.safety,
                              cfg.group_size, cfg.end_to_end_check, cfg.rounds,
                              Scoring(cfg.sensitivity.method, cfg.sensitivity.top_k), ctx.units("sensitivity"),
                              _cluster(ctx, model), **runtime)
        doc, decisions = make_plan(model, blocks, stats, request, ctx.workload, progress=ctx.progress)
        sweep = doc.sensitivity or {}
        ctx.log(f"sensitivity: {sweep.get('units')} units, {sweep.get('measured')} measured, "
                f"{sweep.get('reused')} reused from an earlier attempt")
    write_decisions(ctx, decisions)
    ctx.write_artifact(PLAN_FILE, doc.to_yaml())
    metrics = {"planned_groups": len(doc.groups), **{f"groups_{k}": v for k, v in doc.format_counts().items()}}
    if doc.predicted.ppl_increase is not None:
        metrics["predicted_ppl_increase"] = doc.predicted.ppl_increase
    if doc.predicted.linear_speedup is not None:
        metrics["predicted_linear_speedup"] = doc.predicted.linear_speedup
    info = {"notes": doc.notes, **({"sensitivity": doc.sensitivity} if doc.sensitivity else {})}
    return StageResult(metrics=metrics, info=info)


def _cluster(ctx: StageContext, model: Any) -> Callable[[], AbstractContextManager[Any]] | None:
    """The sweep's pool when the pipeline fans out (run.executor: {ray: ...}); None runs it here."""
    executor = ctx.spec.run.executor
    if executor == "local":
        return None
    from opus.cluster.ray_pool import ray_pool
    from opus.cluster.wire import NotShippable, pack_check

    try:
        pack_check(model)
    except NotShippable as exc:
        raise InputError(f"the sweep cannot fan out: {exc}", key="run.executor") from None

    def on_event(name: str, fields: dict[str, Any]) -> None:
        ctx.event(name, **fields)
        if name == "cluster_task_retried":
            ctx.log(f"cluster: task {fields['task']} failed (attempt {fields['attempt']}), retried: {fields['error']}")
        elif name == "cluster_connected":
            ctx.log(f"cluster: {fields['address']}, {fields['nodes']} node(s), {fields['cpus']:g} CPUs, "
                    f"{fields['slots']} task(s) at a time")

    return lambda: ray_pool(executor.ray, on_event)


def _user_plan(path: Path, model: Any, note: str | None = None) -> PlanDocument:
    doc = read_plan(path)
    names = {n for n, _ in model.named_modules()}
    missing = sorted(set(doc.assignment()) - names)
    if missing:
        raise InputError(f"plan names modules the model does not have: {', '.join(missing[:5])}", file=str(path))
    doc.notes.append(note or f"hand-edited plan from {path}")
    return doc
