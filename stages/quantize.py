"""quantize: apply the plan with real kernels (SmoothQuant W8A8, weight-only int8/int4, FP8 on CUDA)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opus.errors import InputError
from opus.pipeline.context import StageContext, StageResult
from opus.pipeline.contracts import Failure
from opus.quant.apply import QuantizeStep, quantize_model
from opus.quant.calibrate import CALIBRATION_FILE, ActivationStats
from opus.quant.formats import is_noop, noop_name, promote
from opus.quant.plan_file import PLAN_FILE, PlanDocument, read_plan
from opus.quant.tied import HEAD, share_embedding, shared_embedding_step, why_not_shared
from opus.runtime.data import load_blocks
from opus.runtime.metrics import Progress, evaluate_lm, model_mb

VERSION = "1"
ROLE = "transform"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = frozenset({"quantized_layers", "model_mb", "perplexity", "top1_accuracy", "eval_tokens"})
ACCURACY_METRICS = {"perplexity", "top1_accuracy", "agreement", "logits_cosine", "top5_overlap"}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    promote: int = Field(0, ge=0, description="move the N most sensitive groups one step up the ladder")
    promote_step: int = Field(2, gt=0, description="how many more groups each gate retry promotes")
    alpha: float | None = Field(None, gt=0, lt=1, description="SmoothQuant strength; None: chosen per group")
    measure: bool = Field(True, description="perplexity and top-1 on the evaluation text, for gates")
    share_tied_embedding: bool = Field(
        True, description="a tied model whose lm_head is int8 per row (W8A8, W8A16) looks its embeddings up in "
                          "those rows, and the float table goes (the lookup rounds it to int8; measured below)")


def _plan(ctx: StageContext) -> tuple[PlanDocument, ActivationStats]:
    """The nearest upstream stage's plan and the calibration statistics it was made from."""
    for upstream in reversed(list(ctx.upstream.values())):
        if upstream.artifact(PLAN_FILE).is_file():
            return read_plan(upstream.artifact(PLAN_FILE)), ActivationStats.load(upstream.artifact(CALIBRATION_FILE))
    raise InputError("quantize needs an upstream plan stage: no plan.yaml among its inputs (a plan stage "
                     "that was rolled back or skipped leaves none)")


def promoted_groups(doc: PlanDocument, count: int) -> list[dict[str, Any]]:
    """The ``count`` quantized groups whose assigned format hurts most, each promoted one step."""
    quantized = [g for g in doc.groups if not is_noop(g.format)]
    ranked = sorted(quantized, key=lambda g: g.score.get(g.format, 0.0), reverse=True)
    allowed = sorted({f for g in doc.groups for f in g.time_ms})
    changes = []
    for group in ranked[:count]:
        new = promote(group.format, allowed) or noop_name()
        changes.append({"group": group.name, "from": group.format, "to": new})
        group.format = new
    return changes


def run(ctx: StageContext, cfg: Config) -> StageResult:
    doc, stats = _plan(ctx)
    changes = promoted_groups(doc, cfg.promote)
    loaded = ctx.load_model()
    model = loaded.model
    ctx.progress(0, 2, "quantizing")
    step = quantize_model(model, doc.assignment(), stats, group_size=doc.group_size, alpha=cfg.alpha)
    ctx.write_artifact("plan.applied.yaml", doc.to_yaml())
    recipe, shared = [step], _share_embedding(ctx, cfg, model, step)
    if shared["shared"]:
        recipe.append(shared_embedding_step())
    metrics: dict[str, Any] = {"quantized_layers": len(step.layers), "model_mb": model_mb(model)}
    if cfg.measure and ctx.spec.data.evaluation is not None:
        blocks = load_blocks(ctx.spec.data.evaluation, loaded.tokenizer, ctx.base_dir)
        metrics.update(evaluate_lm(model, blocks, progress=Progress(ctx.progress)))
    ctx.progress(2, 2, "quantized")
    return StageResult(metrics=metrics, model=model, recipe=recipe,
                       info={"promoted": changes, "smoothing_alpha": step.smoothing_alpha, "tied_embedding": shared})


def _share_embedding(ctx: StageContext, cfg: Config, model: Any, step: QuantizeStep) -> dict[str, Any]:
    """One table for a tied model's embedding and int8 lm_head (``opus.quant.tied``), where it can be."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {"shared": False, "reason": "not tied"}
    if HEAD not in step.layers:
        return {"shared": False, "reason": "the lm_head stays float: it and the embedding share the float table"}
    why = why_not_shared(model) if cfg.share_tied_embedding else "share_tied_embedding is off"
    if why is None:
        before = model_mb(model)
        share_embedding(model)
        ctx.log(f"the embedding reads the int8 lm_head's rows: {before:.1f} -> {model_mb(model):.1f} MB")
    else:
        ctx.log(f"the tied embedding keeps its float table: {why}")
    return {"shared": why is None, "reason": why}


def remedy(cfg: Config, failure: Failure) -> Config | None:
    """An accuracy gate failed: promote the next most sensitive groups one step up."""
    if failure.metric not in ACCURACY_METRICS:
        return None
    return cfg.model_copy(update={"promote": cfg.promote + cfg.promote_step})
