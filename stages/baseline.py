"""Measure the unmodified model (P, D, peak memory, perplexity, top-1) and save the fidelity reference.

The reference (``reference.safetensors``: a few fixed prompts, the model's greedy continuation and
its logits) lets later eval stages compute agreement, logits cosine and top-5 overlap without
running the baseline model again.
"""

from __future__ import annotations

from pydantic import Field

from opus.pipeline.context import StageContext, StageResult
from stages import REFERENCE, SUITE_METRICS, MeasureConfig, measure_incoming

VERSION = "1"
ROLE = "baseline"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = SUITE_METRICS  # what a gate on this stage can name (checked before a run)


class Config(MeasureConfig):
    fidelity_prompts: int = Field(4, gt=0)  # prompts: the first evaluation blocks (else random ids)
    fidelity_prompt_len: int = Field(64, gt=0)
    fidelity_tokens: int = Field(16, gt=0)  # greedy tokens generated per prompt


def run(ctx: StageContext, cfg: Config) -> StageResult:
    from opus.runtime.engine import supports_cache
    from opus.runtime.metrics import fidelity_prompts, fidelity_units, make_reference

    measured = measure_incoming(ctx, cfg, extra_units=fidelity_units(cfg.fidelity_tokens))
    model = measured.loaded.model
    if supports_cache(model):
        prompts, source = fidelity_prompts(model, measured.inputs, cfg.fidelity_prompts, cfg.fidelity_prompt_len)
        if source != "text" and measured.inputs.eval_blocks is not None:
            ctx.log(f"fidelity prompts are random token ids: the evaluation blocks are fewer than "
                    f"{cfg.fidelity_prompts} or shorter than {cfg.fidelity_prompt_len} tokens")
        measured.info["fidelity_prompts"] = source
        reference = make_reference(model, prompts, cfg.fidelity_tokens, measured.factory, measured.progress)
        reference.save(ctx.artifact_dir / REFERENCE)
    else:
        ctx.log("no fidelity reference: the model does not follow Opus's LM interface")
    return StageResult(metrics=measured.metrics, baseline=True, info=measured.info)
