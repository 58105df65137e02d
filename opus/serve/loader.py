"""From a run or export directory to a running engine: the model, its KV pool, its limits.

The KV budget and the decode compilation come from the run's own choices: the kv_config stage's
recipe step (opus.kv.choice.KVCacheStep: the cache and the sizing it was chosen under) gives the
memory the run gave caches, and a ``static`` (or ``cuda_graph``) cache with ``compile`` true means
the run decodes through compiled static-shape steps, which the server does too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opus.errors import InputError
from opus.kv.sizing import kv_bytes_per_token, memory_budget
from opus.serve.blocks import BlockManager
from opus.serve.kv_blocks import KVBlockPool, PoolShape
from opus.serve.scheduler import Engine

MB = 1024 * 1024
COMPILED_KINDS = ("static", "cuda_graph")


@dataclass
class ServeSettings:
    max_batch: int = 32
    kv_budget_mb: float | None = None  # default: the run's kv_config budget, else a quarter of free memory
    block_size: int = 16
    max_waiting: int = 256
    prefill_chunk: int = 512
    step_tokens: int | None = None  # tokens one step computes, decode rows first; default max(512, 2 × max_batch)
    compile: bool | None = None  # default: as the run chose
    prefix_caching: bool = True


@dataclass
class Served:
    """What the server serves, and the limits it was given (shown on /v1/models and at start)."""

    engine: Engine
    tokenizer: Any
    name: str
    path: Path
    kv_cache: dict[str, Any] | None
    budget_mb: float
    budget_source: str
    eos_ids: frozenset[int]

    def describe(self) -> str:
        e = self.engine
        mode = "compiled" if e.steps.compiled else "eager"
        return (f"{self.name}: context {e.max_context}, max batch {e.max_batch}, {e.step_tokens} tokens a step, "
                f"{e.blocks.usable} KV blocks of "
                f"{e.blocks.block_size} tokens ({self.budget_mb:.0f} MB, {self.budget_source}), {mode} decode steps "
                f"(buckets {', '.join(map(str, e.steps.buckets))})")




def load_served(path: Path, settings: ServeSettings, name: str | None = None, trust_code: bool = False) -> Served:
    from opus.kv.choice import cache_config_from_recipe, sizing_from_recipe
    from opus.made import load_made
    from opus.models.decoder import DecoderLM
    from opus.runtime.engine import eos_ids

    loaded, origin = load_made(path, trust_code=trust_code)
    model = loaded.model
    if not isinstance(model, DecoderLM):
        raise InputError(f"{type(model).__name__} is not an Opus decoder; opus serve runs Opus's decoders only",
                         file=str(path))
    if loaded.tokenizer is None:
        raise InputError("the model has no tokenizer: a server needs one to read prompts", file=str(path))
    model.eval()
    cfg = model.config
    sizing = sizing_from_recipe(loaded.state.get("recipe"))
    if settings.kv_budget_mb:
        budget_mb, source = settings.kv_budget_mb, "--kv-budget-mb"
    elif sizing is not None:
        budget_mb, source = sizing.memory_budget_mb, "the run's kv_config budget"
    else:
        budget_mb, source = memory_budget(0.25) / MB, "a quarter of the memory available"
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    limits = [cfg.max_position_embeddings, *([cfg.sliding_window] if cfg.sliding_window else [])]
    if sizing is not None:
        limits.append(sizing.max_context)
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    # More than every row at the full context is never used (the rest would only hold cached prefixes).
    most = settings.max_batch * min(limits) * per_token / MB
    if budget_mb > most:
        budget_mb, source = most, f"{source}, capped at max batch × context"
    num_blocks = int(budget_mb * MB) // (per_token * settings.block_size) + 1  # + the scratch block
    shape = PoolShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, settings.block_size, dtype, device)
    kv_cache = cache_config_from_recipe(loaded.state.get("recipe"))
    compile_decode = settings.compile
    if compile_decode is None:
        compile_decode = compiled_choice(kv_cache)
    engine = Engine(model, KVBlockPool(shape), BlockManager(num_blocks, settings.block_size, settings.prefix_caching),
                    max_batch=settings.max_batch, max_waiting=settings.max_waiting, max_context=min(limits),
                    prefill_chunk=settings.prefill_chunk,
                    step_tokens=settings.step_tokens or max(512, 2 * settings.max_batch), compile_decode=compile_decode)
    return Served(engine, loaded.tokenizer, name or _name_of(origin, path), origin, kv_cache, budget_mb,
                  source, eos_ids(loaded.tokenizer, model))


def compiled_choice(kv_cache: dict[str, Any] | None) -> bool:
    """Whether the run chose compiled decode steps: a static (or cuda_graph) cache with ``compile``, or a
    ``by_batch`` choice with such a cache for some batch size (the run chose per batch; the server's decode
    batches span them all)."""
    if not kv_cache:
        return False
    if kv_cache.get("kind") == "by_batch":
        return any(compiled_choice(rule.get("cache")) for rule in kv_cache.get("rules", []))
    return kv_cache.get("kind") in COMPILED_KINDS and bool(kv_cache.get("compile", True))


def _name_of(model_dir: Path, given: Path) -> str:
    return given.resolve().name or str(model_dir)
