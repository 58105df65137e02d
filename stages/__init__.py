"""Opus's built-in stage types: each is one small file, a thin adapter from YAML to ``opus`` mechanisms.

Registered through the ``opus.stages`` entry-point group (see pyproject.toml). What the measuring
stages (baseline, eval) share lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

REFERENCE = "reference.safetensors"  # the baseline's fidelity reference, an artifact of that stage
# The keys opus.runtime.metrics.measure_suite may report (P with the batch's prefill and decode, D with
# decode at batch 1, memory, quality), and what compare_to_reference adds: the measuring stages'
# METRICS, against which gates are checked before a run.
SUITE_METRICS = frozenset({"model_mb", "throughput_tok_s", "peak_mem_mb", "peak_mem_rise_mb", "prefill_ms_batch",
                           "decode_tok_s_batch", "ttft_ms", "decode_tok_s", "perplexity", "top1_accuracy",
                           "eval_tokens"})
FIDELITY_METRICS = frozenset({"agreement", "agreement_free", "logits_cosine", "top5_overlap"})


class MeasureConfig(BaseModel):
    """What to measure; the workload itself comes from the pipeline's ``workload:``."""

    model_config = ConfigDict(extra="forbid")

    throughput: bool = True  # P and peak memory
    ttft: bool = True  # D
    decode_batch1: bool = True  # D runs also decode output_len tokens -> decode_tok_s at batch 1
    quality: bool = True  # perplexity and top-1 (needs data.evaluation)
    eval_batch_size: int = Field(4, gt=0)


@dataclass
class Measured:
    loaded: Any  # opus.models.saved_state.Materialized
    inputs: Any  # opus.runtime.metrics.Inputs
    factory: Any  # opus.kv.cache.CacheFactory
    progress: Any  # opus.runtime.metrics.Progress
    metrics: dict[str, Any]
    info: dict[str, Any]


def measure_incoming(ctx: Any, cfg: MeasureConfig, extra_units: int = 0) -> Measured:
    """Load the incoming model state and measure it under the run's workload.

    The KV cache is the one the state's recipe chose (a ``kv_cache`` step), else the growing cache.
    ``extra_units`` is progress work the stage will do afterwards, so the ETA covers it.
    """
    from opus.kv.cache import cache_factory
    from opus.kv.choice import cache_config_from_recipe
    from opus.kv.compiled_steps import compile_notes
    from opus.runtime.engine import supports_cache
    from opus.runtime.metrics import Progress, Settings, measure_suite, prepare_inputs

    loaded = ctx.load_model()
    cache_config = cache_config_from_recipe(loaded.state.get("recipe"))
    settings = Settings(**cfg.model_dump(include=set(Settings.__dataclass_fields__)))
    if not supports_cache(loaded.model):
        ctx.log(f"{type(loaded.model).__name__} does not follow Opus's LM interface: P and D skipped")
        settings.throughput = settings.ttft = False
    if settings.quality and ctx.spec.data.evaluation is None:
        ctx.log("no data.evaluation declared: perplexity and top-1 accuracy skipped")
    factory = cache_factory(loaded.model, cache_config)
    progress = Progress(ctx.progress)
    progress.expect(extra_units)
    inputs = prepare_inputs(loaded.model, loaded.tokenizer, ctx.workload, ctx.spec.data.evaluation,
                            ctx.base_dir, ctx.log)
    metrics, info = measure_suite(loaded.model, inputs, ctx.workload, settings, factory, progress)
    info["kv_cache"] = cache_config or {"kind": "growing"}
    for note in compile_notes():
        ctx.log(note)
    return Measured(loaded, inputs, factory, progress, metrics, info)
