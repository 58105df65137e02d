"""``profile``: where one prefill and one decode step spend their time, per module and per role.

Leaves the model unchanged. Writes ``profile.json`` (see ``opus.runtime.profiling``; the report draws it);
reports ``profile_prefill_ms``, ``profile_decode_ms``, ``profile_ops_prefill``,
``profile_ops_decode`` and ``share_<role>``. Shapes default to the pipeline's workload; a smaller
``batch_size`` / ``input_len`` keeps the profile cheap on a big model (shares shift with shape).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from opus.kv.cache import cache_factory
from opus.kv.choice import cache_config_from_recipe
from opus.pipeline.context import StageContext, StageResult
from opus.runtime.engine import supports_cache
from opus.runtime.profiling import (
    PHASES,
    PROFILE_FILE,
    ROLES,
    ProfileWorkload,
    profile_metrics,
    profile_model,
    summary_line,
)

VERSION = "1"
ROLE = "measure"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = frozenset({f"profile_{phase}_ms" for phase in PHASES} | {f"profile_ops_{phase}" for phase in PHASES}
                    | {f"share_{role}" for role in ROLES})


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    batch_size: int | None = Field(None, gt=0, description="profiling batch (default: workload.batch_size)")
    input_len: int | None = Field(None, gt=0, description="prompt length (default: workload.input_len)")
    output_len: int | None = Field(None, gt=0, description="decode steps per prefill when weighting shares")
    warmup: int | None = Field(None, ge=0)
    repeats: int | None = Field(None, gt=0)
    top: int = Field(10, ge=0, description="hotspot modules listed")
    max_modules: int = Field(256, ge=0, description="modules kept in profile.json, biggest share first")


def run(ctx: StageContext, cfg: Config) -> StageResult:
    loaded = ctx.load_model()
    model, w = loaded.model, ctx.workload
    workload = ProfileWorkload(
        batch_size=cfg.batch_size or w.batch_size, input_len=cfg.input_len or w.input_len,
        output_len=cfg.output_len or w.output_len,
        warmup=w.warmup if cfg.warmup is None else cfg.warmup, repeats=cfg.repeats or w.repeats)
    # Profile with the KV cache the incoming state would serve with (a kv_config stage may have set it).
    factory = None
    if supports_cache(model):
        factory = cache_factory(model, cache_config_from_recipe(loaded.state.get("recipe")))
    profile = profile_model(model, workload, factory, progress=ctx.progress, top=cfg.top,
                            max_modules=cfg.max_modules)
    ctx.write_artifact(PROFILE_FILE, profile)
    line = summary_line(profile)
    ctx.log(f"profile: {line}")
    return StageResult(metrics=profile_metrics(profile), model=None, info={"profile": line})
