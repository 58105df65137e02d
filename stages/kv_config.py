"""Choose the KV cache for the engine: pooled preallocation, growth step and batch size, measured.

Candidates (``prealloc`` × ``step``, and the growing cache for comparison) run the pipeline's workload
(or the ``input_len``/``output_len`` given here) at each batch size that fits the memory budget;
the fastest wins and is written into the recipe as ``{"kind": "kv_cache", "cache": {...}}``, which
baseline/eval and the engine read to build their cache. The step changes no tensor.

Sizing: bytes per token = 2 × layers × KV heads × head dim × element size; the budget is
``memory_budget_mb`` or ``memory_fraction`` of the memory available now; ``max_batch`` is the largest
number of sequences whose caches, allocated in steps, fit it::

    - id: kv
      uses: kv_config
      needs: fuse
      with: {prealloc: [512], step: [256, 1024], max_context: 8192, memory_fraction: 0.5}
      gate: {kv_exact_match: {min: 1.0}}
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opus.stage import StageContext, StageResult

VERSION = "1"
MB = 1 << 20


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prealloc: list[int] = Field(default_factory=lambda: [512])  # positions each sequence starts with
    step: list[int] = Field(default_factory=lambda: [256, 1024])  # growth step candidates
    max_context: int = Field(8192, gt=0)  # capped by the model's max_position_embeddings
    batch_sizes: list[int] | None = None  # default: the workload's batch size
    memory_fraction: float = Field(0.5, gt=0, le=1)
    memory_budget_mb: float | None = Field(None, gt=0)
    include_growing: bool = True  # measure the growing cache too (and keep it if it wins)
    input_len: int | None = Field(None, gt=0)  # default: the workload's
    output_len: int | None = Field(None, gt=0)
    warmup: int | None = Field(None, ge=0)
    repeats: int | None = Field(None, gt=0)
    seed: int = 0


def _candidates(cfg: Config, max_ctx: int) -> list[dict[str, Any]]:
    from opus.kvpool import cache_config

    out = [cache_config(p, s, max_ctx) for p in cfg.prealloc for s in cfg.step]
    return out + ([{"kind": "growing"}] if cfg.include_growing else [])


def _fits(cache: dict[str, Any], budget: int, per_token: int, context: int) -> int:
    from opus.kvpool import max_batch

    if cache["kind"] == "growing":  # holds exactly the context (plus a transient copy while growing)
        return max(0, budget // (2 * per_token * context))
    return max_batch(budget, per_token, context, cache["prealloc"], cache["step"], cache["max_context"])


def _same_tokens(model: Any, cache: dict[str, Any], vocab: int, seed: int) -> float:
    """Greedy tokens through ``cache`` vs the growing cache on a small batch (1.0 = identical)."""
    from opus.data import random_blocks
    from opus.engine import generate, model_device
    from opus.kvcache import cache_factory

    prompts = random_blocks(2, 16, vocab, seed).to(model_device(model))
    want = generate(model, prompts, 8, cache_factory(model)).tokens
    got = generate(model, prompts, 8, cache_factory(model, cache)).tokens
    return float((want == got).float().mean())


def run(ctx: StageContext, cfg: Config) -> StageResult:
    import torch

    from opus.data import random_blocks
    from opus.engine import model_device, supports_cache
    from opus.kvcache import cache_factory, kv_cache_step
    from opus.kvpool import kv_bytes_per_token, memory_budget
    from opus.metrics import Progress, measure_throughput, vocab_size

    model = ctx.load_model().model
    mc = getattr(model, "config", None)
    if not supports_cache(model) or not all(hasattr(mc, a) for a in ("num_layers", "num_kv_heads", "head_dim")):
        raise ValueError(f"kv_config needs Opus's LM interface (a KV cache and config.num_layers/num_kv_heads/"
                         f"head_dim); {type(model).__name__} has not")
    device = model_device(model)
    dtype = next(model.parameters()).dtype
    max_ctx = min(cfg.max_context, int(getattr(mc, "max_position_embeddings", cfg.max_context)))
    per_token = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    budget = int(cfg.memory_budget_mb * MB) if cfg.memory_budget_mb else memory_budget(cfg.memory_fraction, device)
    wl = ctx.workload
    input_len, output_len = cfg.input_len or wl.input_len, cfg.output_len or wl.output_len
    warmup, repeats = (cfg.warmup if cfg.warmup is not None else wl.warmup), cfg.repeats or wl.repeats
    context = input_len + output_len
    if context > max_ctx:
        raise ValueError(f"the workload needs {context} positions; max_context is {max_ctx}")
    batches = sorted(set(cfg.batch_sizes or [wl.batch_size]))
    candidates = _candidates(cfg, max_ctx)
    progress = Progress(ctx.progress)
    progress.expect(len(candidates) * len(batches) * (max(1, warmup) + repeats) * output_len)
    rows: list[dict[str, Any]] = []
    for cache in candidates:
        fit = _fits(cache, budget, per_token, context)
        for batch in batches:
            row: dict[str, Any] = {"cache": cache, "batch_size": batch, "max_batch": fit}
            rows.append(row)
            if batch > fit:
                row["skipped"] = f"batch {batch} does not fit the budget (max {fit})"
                continue
            prompts = random_blocks(batch, input_len, vocab_size(model), cfg.seed).to(device)
            torch.manual_seed(cfg.seed)
            row.update(measure_throughput(model, prompts, output_len, cache_factory(model, cache), warmup,
                                          repeats, progress))
    measured = [r for r in rows if "throughput_tok_s" in r]
    if not measured:
        raise ValueError(f"no candidate fits the memory budget of {budget / MB:.0f} MB "
                         f"({per_token} KV bytes per token, {context} positions per sequence)")
    best = max(measured, key=lambda r: r["throughput_tok_s"])
    growing = [r for r in measured if r["cache"]["kind"] == "growing" and r["batch_size"] == best["batch_size"]]
    chosen = best["cache"]
    match = _same_tokens(model, chosen, vocab_size(model), cfg.seed) if chosen["kind"] != "growing" else 1.0
    sizing = {"kv_bytes_per_token": per_token, "memory_budget_mb": budget / MB, "context": context,
              "max_context": max_ctx, "max_batch": best["max_batch"], "batch_size": best["batch_size"]}
    step = kv_cache_step(chosen)
    step["sizing"] = sizing  # informational: cache_config_from_recipe reads only "cache"
    metrics: dict[str, Any] = {
        "kv_throughput_tok_s": best["throughput_tok_s"], "kv_peak_mem_mb": best.get("peak_mem_mb"),
        "kv_max_batch": best["max_batch"], "kv_batch_size": best["batch_size"], "kv_bytes_per_token": per_token,
        "kv_pooled": float(chosen["kind"] != "growing"), "kv_exact_match": match}
    if growing:
        metrics["kv_speedup_vs_growing"] = best["throughput_tok_s"] / growing[0]["throughput_tok_s"]
    ctx.write_artifact("kv_config.json", {"chosen": chosen, "sizing": sizing, "candidates": rows,
                                          "workload": {"input_len": input_len, "output_len": output_len,
                                                       "batch_sizes": batches, "repeats": repeats}})
    return StageResult(metrics=metrics, recipe=[step], info={"kv_cache": chosen})
