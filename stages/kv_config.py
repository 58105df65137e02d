"""Choose the KV cache for the engine, per batch size, by measurement.

Candidates come from the registry of cache kinds (``opus.kv.cache.registered_kinds``): each kind
turns this stage's settings into configs to measure and says why one cannot run for the model.
Opus's own: the pooled preallocated cache (``prealloc`` × ``step``), the growing cache, the static
cache whose decode steps run as one compiled graph (``opus.kv.static``; Opus decoders only; once with
torch's attention and once with Opus's blocked causal attention, ``static_attention``, whose bf16 variant
``blocked_bf16`` races only if the perplexity of a prefill through it is within ``max_kv_ppl_increase`` of
the model's own attention's; and with K/V
kept in bfloat16 or int8, ``static_kv_dtypes``, which races only if the perplexity of text decoded through it
is within ``max_kv_ppl_increase`` of the growing cache's, ``kv_fidelity`` in kv_config.json; and with
each value of the quantization formats' kernel choices that ``kernel_choices`` lists: W8A8 layers taking
the int8 GEMM from fewer rows, ``w8a8_weight_only_rows``, or through oneDNN's or FBGEMM's packed kernel
at prefill, decode or both, ``w8a8_packed_gemm``; opus.kv.kernel_choices), and
the static cache whose decode steps are captured in a CUDA graph (``opus.kv.cuda_graph``; on CUDA,
or uncaptured with ``cuda_graph: true``). A candidate that cannot run is logged and listed under
``unavailable`` in ``kv_config.json`` with the reason. They run the pipeline's workload (or the
``input_len``/``output_len`` given here) at each batch size that fits the memory budget (default:
1 and the workload's), in interleaved rounds (``repeats``), each round timed as the prefill plus
the median decode step for every step. At each batch size the shared rule of
``opus.runtime.timed_choice`` picks: the fastest, unless others are within the noise margin of it;
among those tied, the one whose time to first token is shortest beyond its own noise margin (the
same rule over the prefills of the same rounds: a compiled prefill that a request's decode steps
hide still shortens D), then the simpler wins (each kind's ``simplicity``: growing, pooled, static,
CUDA graph); ``decisions.json`` keeps the rounds, margin and reason of both. Where the winners
differ (a compiled static step wins at batch 1, where per-op dispatch bounds a step, and a pooled
cache at batch 32), the recipe gets a ``by_batch`` cache that picks by the request's batch size. With
``run.decisions_from`` the caches of that run are measured and kept instead. The choice is written
into the recipe as ``{"kind": "kv_cache", "cache": {...}}``, which baseline/eval and the engine
read to build their cache. The step changes no tensor.

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

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from opus.errors import InputError
from opus.kv.choice import KV_CONFIG_FILE
from opus.kv.kernel_choices import check_value, choice
from opus.models.attention import LOSSY_KERNELS
from opus.pipeline.context import StageContext, StageResult
from opus.pipeline.replay import source_artifact
from opus.runtime.timed_choice import DEFAULT_ROUNDS, replayed, write_decisions

VERSION = "1"
ROLE = "transform"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = frozenset({"kv_throughput_tok_s", "kv_peak_mem_mb", "kv_max_batch", "kv_batch_size",
                     "kv_bytes_per_token", "kv_pooled", "kv_exact_match", "kv_by_batch",
                     "kv_speedup_vs_growing", "kv_speedup_vs_growing_b*", "kv_ppl_increase"})
MB = 1 << 20


# The kernel-choice keys of before the choices moved onto the formats: pipeline files written then still
# run (each is folded into ``kernel_choices``).
OLD_CHOICE_KEYS = {"static_w8a8_weight_only_rows": "w8a8_weight_only_rows",
                   "static_w8a8_packed_gemm": "w8a8_packed_gemm"}


def _kernel_choices(raced: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Each option a registered kernel choice, each value one it takes: one line saying what may be written."""
    import opus.quant.formats  # noqa: F401 - registering the formats registers their kernel choices

    for option, values in raced.items():
        choice(option)
        for value in values:
            check_value(option, value)
    return raced


# option -> the values to race (null: the layers' default), e.g. {w8a8_packed_gemm: [null, prefill]}.
KernelChoices = Annotated[dict[str, Annotated[list[Any], Field(min_length=1)]], AfterValidator(_kernel_choices)]


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prealloc: list[int] = Field(default_factory=lambda: [512])  # positions each sequence starts with
    step: list[int] = Field(default_factory=lambda: [256, 1024])  # growth step candidates
    max_context: int = Field(8192, gt=0)  # capped by the model's max_position_embeddings
    batch_sizes: list[int] | None = None  # default: 1 and the workload's batch size
    memory_fraction: float = Field(0.5, gt=0, le=1)
    memory_budget_mb: float | None = Field(None, gt=0)
    include_growing: bool = True  # measure the growing cache too (and keep it if it wins)
    include_static: bool = True  # and the static cache with compiled decode steps (Opus decoders)
    # And that cache with its prefill compiled too (padded to buckets): off by default, since each prompt
    # bucket compiles a graph of the whole model (about a minute on K3); on K3 it has won at both batch
    # sizes since int8 K/V (pipelines/k3.yaml turns it on). The plan stage's end-to-end check follows it.
    include_static_prefill: bool = False
    static_slot_multiple: int = Field(128, gt=0)  # its slots: request length rounded up to this
    # Its attention kernels, each a candidate of its own: torch's SDPA, and Opus's blocked kernel
    # (opus.models.attention: a causal prefill in query blocks; CPU only).
    # ``blocked_bf16``: the blocked kernel's C++ op with its two products in bf16 (AVX-512 BF16; fp32 sums and
    # softmax): lossy, so it races only if the perplexity of a prefill through it (kv_fidelity.ppl_of_prefill)
    # is within max_kv_ppl_increase of the model's own attention's.
    static_attention: list[Literal["sdpa", "blocked", "blocked_bf16"]] = Field(
        default_factory=lambda: ["sdpa", "blocked"], min_length=1)
    # The dtypes it may keep K/V in, each a candidate: null = the model's; bfloat16/float16 halve the
    # bytes a decode step reads, int8 (a scale per token and head, opus.kv.stored) quarters them; all are
    # lossy: such a cache races only if the perplexity of text decoded through it (teacher-forced,
    # opus.runtime.kv_fidelity) is within max_kv_ppl_increase of the growing cache's.
    static_kv_dtypes: list[Literal["bfloat16", "float16", "int8"] | None] = Field(default_factory=lambda: [None],
                                                                         min_length=1)
    max_kv_ppl_increase: float = Field(0.005, ge=0)  # relative: 0.005 = +0.5 %
    # The quantization formats' kernel choices (opus.kv.kernel_choices) the static cache's compiled steps race,
    # each value a candidate; null = the layers' default. W8A8's: ``w8a8_weight_only_rows`` (up to how many
    # rows a layer runs its weight-only kernel: 1 = the int8 GEMM with per-token activations from two rows on,
    # which won on an AMX Xeon and lost on an AMD EPYC) and ``w8a8_packed_gemm`` (the int8 GEMMs through a
    # packed kernel, opus.quant.packed: prefill / decode / both = oneDNN's there, or a kernel per phase,
    # {prefill: onednn, decode: fbgemm}; oneDNN's won the prefill and lost the decode on K3's tiny layers and
    # won both on the 135M shape; FBGEMM's won one-row decode there, AMX Xeon).
    kernel_choices: KernelChoices = Field(default_factory=dict)
    # Where the static cache's compiled steps run W8A8's int8 GEMMs through a packed kernel
    # (opus.quant.packed), each a candidate: null = torch._int_mm; prefill / decode / both = oneDNN's there;
    # or a kernel per phase, {prefill: onednn, decode: fbgemm}. oneDNN's won the prefill and lost the decode
    # on K3's tiny layers and won both on the 135M shape; FBGEMM's won one-row decode there (AMX Xeon).
    # The static cache with CUDA-graph decode steps (opus.kv.cuda_graph): None measures it on CUDA and
    # reports it unavailable elsewhere; true measures the same step uncaptured off CUDA (CPU CI); false never.
    cuda_graph: bool | None = None
    input_len: int | None = Field(None, gt=0)  # default: the workload's
    output_len: int | None = Field(None, gt=0)
    warmup: int | None = Field(None, ge=0)
    repeats: int | None = Field(None, gt=0)  # timed rounds; default: 5, or the workload's repeats if more
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _old_choice_keys(cls, data: Any) -> Any:
        """``static_w8a8_weight_only_rows: [...]`` as written before: ``kernel_choices.w8a8_weight_only_rows``."""
        if not isinstance(data, dict) or not set(data) & set(OLD_CHOICE_KEYS):
            return data
        data = dict(data)
        raced = dict(data.get("kernel_choices") or {})
        for old, option in OLD_CHOICE_KEYS.items():
            if old in data:
                if option in raced:
                    raise ValueError(f"{old} and kernel_choices.{option} say the same: keep kernel_choices")
                raced[option] = data.pop(old)
        return {**data, "kernel_choices": raced}


def _candidates(cfg: Config, max_ctx: int, model: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every registered kind's configs for these settings: (those that can run here, those that cannot,
    each with the kind's reason). Kinds are asked through the registry (opus.kv.cache), never by name."""
    from opus.kv.cache import registered_kinds
    from opus.runtime.engine import model_device

    settings = cfg.model_dump() | {"max_context": max_ctx, "device": str(model_device(model))}
    runnable, unavailable = [], []
    for kind in registered_kinds():
        for cache in kind.candidates(settings):
            options = {k: v for k, v in cache.items() if k not in ("kind", "provider")}
            reason = kind.unavailable(model, options)
            (unavailable if reason else runnable).append({"cache": cache, **({"skipped": reason} if reason else {})})
    # The order of the candidates of old (pooled first, then growing, then static): rows and labels
    # in kv_config.json keep their places; new kinds come last.
    order = {"pooled": 0, "growing": 1, "static": 2}
    runnable.sort(key=lambda r: order.get(r["cache"]["kind"], len(order)))
    return [r["cache"] for r in runnable], unavailable


def _kind(cache: dict[str, Any]) -> Any:
    from opus.kv.cache import kind_of

    return kind_of(cache["kind"], cache.get("provider"))


def _options(cache: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cache.items() if k not in ("kind", "provider")}


def _fits(cache: dict[str, Any], budget: int, per_token: int, context: int) -> int:
    return _kind(cache).max_batch(budget, per_token, context, _options(cache))


def _label(cache: dict[str, Any]) -> str:
    """A cache config in a few words, unique among the candidates: ``pooled prealloc 512, step 256``."""
    options = ", ".join(f"{k} {_as_written(v)}" for k, v in cache.items()
                        if k not in ("kind", "provider", "max_context"))
    return f"{cache['kind']} {options}".strip()


def _as_written(value: Any) -> str:
    """A mapping as a pipeline file spells it (``{prefill: onednn, decode: fbgemm}``), anything else as is."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def _race(model: Any, prompts: Any, output_len: int, rows: list[dict[str, Any]], warmup: int, rounds: int,
          progress: Any) -> tuple[Any, dict[str, Any]]:
    """Time the rows' caches at one batch size in interleaved rounds (opus.runtime.timed_choice); fill each row's P
    figures and the peak memory of its first timed run. Returns the decision and the winning row."""
    from contextlib import nullcontext

    from opus.kv.cache import cache_factory
    from opus.runtime.engine import model_device, timed_generate
    from opus.runtime.metrics import PeakMemory, memory_figures, throughput_figures
    from opus.runtime.timed_choice import Option, decide, reported

    runs: dict[str, list[Any]] = {}

    def option(row: dict[str, Any]) -> Option:
        label, factory = _label(row["cache"]), cache_factory(model, row["cache"])
        seen = runs.setdefault(label, [])  # warm-up runs first

        def run() -> float:  # batch seconds: the prefill, and the median step for every step
            memory = PeakMemory(model_device(model)) if len(seen) == warmup else None
            with memory or nullcontext():
                result, prefill, step = timed_generate(model, prompts, output_len, factory,
                                                       on_step=lambda _: progress.advance(1, "P"))
            seen.append(result)
            if memory is not None:
                row.update(memory_figures(memory))
            return prefill + (output_len - 1) * step if output_len > 1 else prefill

        # Between caches equally fast within the noise: the one with less machinery (the kind says).
        return Option(label, run, simplicity=_kind(row["cache"]).simplicity_of(_options(row["cache"])))

    options = [option(row) for row in rows]
    decision = decide(f"KV cache at batch {prompts.shape[0]}", options, rounds, warmup=warmup, timer=reported,
                      on_repeat=lambda: progress.expect(len(rows) * rounds * output_len))
    decisions = [decision]
    if len(decision.tied) > 1:
        first_token = _first_token_among_tied(decision, options, {n: [r.ttft_s for r in runs[n][warmup:]]
                                                                  for n in decision.tied})
        decisions.append(first_token)
    for row, opt in zip(rows, options):
        row.update(throughput_figures(runs[opt.name][warmup:], output_len), label=opt.name)
    return decisions, next(row for row, opt in zip(rows, options) if opt.name == decision.winner)


def _first_token_among_tied(decision: Any, options: list[Any], prefill_s: dict[str, list[float]]) -> Any:
    """Among the caches tied on the request's time, the one with the shortest time to first token (the
    shared rule over the prefills of the same rounds; tied again, the simpler, unless another prefilled faster
    in every round: choose.faster_every_round). The request's decision then names it, and its reason says why."""
    from opus.runtime.timed_choice import decide_from, faster_every_round

    tied = [o for o in options if o.name in decision.tied]
    first_token = decide_from(f"time to first token, among the KV caches tied {decision.what[len('KV cache '):]}",
                              tied, prefill_s)
    # The margin is each cache's spread over the rounds: a machine slowing down part-way widens it though
    # every cache slowed alike. A cache whose prefill was shorter than the pick's in every round is faster.
    paired = faster_every_round(first_token)
    if paired is not None:
        first_token.reason += (f"; but {paired[0]} prefilled faster than {first_token.winner} in every one of the "
                               f"{len(prefill_s[paired[0]])} rounds (median ratio ×{paired[1]:.3f}), so it serves")
        first_token.winner = paired[0]
    if first_token.winner != decision.winner:
        fastest = min(decision.medians, key=lambda n: (decision.medians[n], n))
        where = ("fastest" if first_token.winner == fastest
                 else f"tied with the fastest ({fastest})")
        how = "a shorter time to first token in every round" if paired else "the shortest time to first token"
        decision.reason = (f"{where}; of the {len(tied)} tied within the {decision.margin:.1%} noise margin, "
                           f"{how} ({first_token.medians[first_token.winner] * 1e3:.2f}"
                           f" against {first_token.medians[decision.winner] * 1e3:.2f} ms for the simpler "
                           f"{decision.winner})")
        decision.winner = first_token.winner
    return first_token


def _replayed(path: Any, batches: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Per batch size, the one cache the earlier run's kv_config.json chose there."""
    from opus.errors import InputError
    from opus.kv.cache import cache_for_batch
    from opus.kv.choice import read_kv_report

    report = read_kv_report(path)
    out = {}
    for batch in batches:  # a batch size the earlier run did not measure: what its recipe ran there
        cache = report.winners.get(str(batch)) or cache_for_batch(report.chosen, batch)
        if cache is None:
            raise InputError(f"run.decisions_from: no KV cache chosen for batch {batch} to replay", file=str(path))
        out[batch] = [cache]
    return out


def _choice(winners: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One cache config, or a by_batch one: each measured batch size gets its winner, batch sizes in
    between the next larger measured one's, and larger ones the largest's."""
    from opus.kv.cache import by_batch_config

    rules: list[tuple[int | None, dict[str, Any]]] = []
    for batch, row in winners.items():
        if rules and rules[-1][1] == row["cache"]:
            rules[-1] = (batch, row["cache"])
        else:
            rules.append((batch, row["cache"]))
    if len(rules) == 1:
        return dict(rules[0][1])
    return by_batch_config([*rules[:-1], (None, rules[-1][1])])


def _faithful(ctx: StageContext, model: Any, tokenizer: Any, candidates: list[dict[str, Any]],
              cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The lossy candidates (K/V kept narrower than the model; a lossy prefill attention kernel) measured for
    perplexity (opus.runtime.kv_fidelity), each lossy part once: (those that may race, those refused with the
    reason, each lossy cache's figures by label: its one part's, or both parts' with their increases summed)."""
    measured: dict[tuple[str, str], dict[str, Any]] = {}
    kept, refused, figures = [], [], {}
    for cache in candidates:
        parts = _lossy_parts(cache)
        if not parts:
            kept.append(cache)
            continue
        for part in parts:
            if part not in measured:
                measured[part] = _lossy_part(ctx, model, tokenizer, cache, part, cfg.seed)
        found = [measured[part] for part in parts]
        figures[_label(cache)] = found[0] if len(found) == 1 else {
            "increase": sum(f["increase"] for f in found), "parts": found, "text": found[0]["text"],
            "measured_with": " + ".join(f["measured_with"] for f in found)}
        increase = figures[_label(cache)]["increase"]
        if increase > cfg.max_kv_ppl_increase:
            refused.append({"cache": cache, "skipped": f"perplexity {increase:+.3%} against the exact one's "
                                                       f"({figures[_label(cache)]['measured_with']}), beyond "
                                                       f"max_kv_ppl_increase {cfg.max_kv_ppl_increase:.3%}"})
        else:
            kept.append(cache)
    return kept, refused, figures


def _lossy_parts(cache: dict[str, Any]) -> list[tuple[str, str]]:
    """What makes ``cache`` lossy: ("kv_dtype", its dtype), ("attention", a lossy kernel), both or neither."""
    return [part for part in (("kv_dtype", cache.get("kv_dtype")), ("attention", cache.get("attention")))
            if part[1] and (part[0] == "kv_dtype" or part[1] in LOSSY_KERNELS)]


def _lossy_part(ctx: StageContext, model: Any, tokenizer: Any, cache: dict[str, Any], part: tuple[str, str],
                seed: int) -> dict[str, Any]:
    from opus.kv.static import DEFAULT_SLOT_MULTIPLE
    from opus.runtime.kv_fidelity import measure_lossy_part

    multiple = int(cache.get("slot_multiple", DEFAULT_SLOT_MULTIPLE))
    figures, config, shape = measure_lossy_part(model, part, multiple, ctx.spec.data.evaluation, tokenizer,
                                                ctx.base_dir, seed)
    exact = "growing cache" if part[0] == "kv_dtype" else "the model's own attention, one prefill"
    ctx.log(f"KV cache {_label(config)}: perplexity through the cache {figures['ppl']:.4f} against "
            f"{figures['reference_ppl']:.4f} ({exact}, {figures['text']}, {shape[0]} × {shape[1]} tokens): "
            f"{figures['increase']:+.3%}")
    return {**figures, "measured_with": _label(config)}


def _same_tokens(model: Any, row: dict[str, Any], input_len: int, output_len: int, vocab: int, seed: int) -> float:
    """Greedy tokens through the row's cache vs the growing cache, at its batch size (1.0 = identical)."""
    from opus.kv.cache import cache_factory
    from opus.runtime.data import random_blocks
    from opus.runtime.engine import generate, model_device

    prompts = random_blocks(row["batch_size"], input_len, vocab, seed + 1).to(model_device(model))
    want = generate(model, prompts, output_len, cache_factory(model)).tokens
    got = generate(model, prompts, output_len, cache_factory(model, row["cache"])).tokens
    return float((want == got).float().mean())


def run(ctx: StageContext, cfg: Config) -> StageResult:
    import torch

    from opus.kv.choice import KVConfigReport, KVSizing, KVWorkload, kv_cache_step
    from opus.kv.compiled_steps import compile_notes
    from opus.kv.sizing import kv_bytes_per_token, memory_budget
    from opus.runtime.data import random_blocks
    from opus.runtime.engine import model_device, supports_cache
    from opus.runtime.metrics import Progress, vocab_size

    loaded = ctx.load_model()
    model = loaded.model
    mc = getattr(model, "config", None)
    if not supports_cache(model) or not all(hasattr(mc, a) for a in ("num_layers", "num_kv_heads", "head_dim")):
        raise InputError(f"kv_config needs Opus's LM interface (a KV cache and config.num_layers/num_kv_heads/"
                         f"head_dim); {type(model).__name__} has not")
    device = model_device(model)
    dtype = next(model.parameters()).dtype
    max_ctx = min(cfg.max_context, int(getattr(mc, "max_position_embeddings", cfg.max_context)))
    per_token = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    budget = int(cfg.memory_budget_mb * MB) if cfg.memory_budget_mb else memory_budget(cfg.memory_fraction, device)
    wl = ctx.workload
    input_len, output_len = cfg.input_len or wl.input_len, cfg.output_len or wl.output_len
    warmup = cfg.warmup if cfg.warmup is not None else wl.warmup
    context = input_len + output_len
    if context > max_ctx:
        raise InputError(f"the workload needs {context} positions; max_context is {max_ctx}", key="workload")
    batches = sorted(set(cfg.batch_sizes or [1, wl.batch_size]))
    replay = source_artifact(ctx, KV_CONFIG_FILE)  # run.decisions_from: that run's caches
    candidates, unavailable = ([], []) if replay else _candidates(cfg, max_ctx, model)
    fidelity: dict[str, Any] = {}
    if any(_lossy_parts(c) for c in candidates):
        candidates, refused, fidelity = _faithful(ctx, model, loaded.tokenizer, candidates, cfg)
        unavailable += refused
    for row in unavailable:  # never silently: logged, and listed in kv_config.json
        ctx.log(f"KV cache {_label(row['cache'])} skipped: {row['skipped']}")
    plans = _replayed(replay, batches) if replay else dict.fromkeys(batches, candidates)
    rounds = cfg.repeats or max(DEFAULT_ROUNDS, wl.repeats)
    progress = Progress(ctx.progress)
    progress.expect(sum(map(len, plans.values())) * (max(1, warmup) + rounds) * output_len)
    rows: list[dict[str, Any]] = []
    decisions, winners = [], {}
    for batch, caches in plans.items():
        here = [{"cache": c, "batch_size": batch, "max_batch": _fits(c, budget, per_token, context)} for c in caches]
        for row in here:
            if batch > row["max_batch"]:
                row["skipped"] = f"batch {batch} does not fit the budget (max {row['max_batch']})"
        rows += here
        fitting = [r for r in here if "skipped" not in r]
        if fitting:
            prompts = random_blocks(batch, input_len, vocab_size(model), cfg.seed).to(device)
            torch.manual_seed(cfg.seed)
            raced, winners[batch] = _race(model, prompts, output_len, fitting, max(1, warmup), rounds, progress)
            decisions += [replayed(raced[0].what, raced[0].winner, str(replay))] if replay else raced
    measured = [r for r in rows if "throughput_tok_s" in r]
    if not measured:
        raise ValueError(f"no candidate fits the memory budget of {budget / MB:.0f} MB "
                         f"({per_token} KV bytes per token, {context} positions per sequence)")
    best = max(winners.values(), key=lambda r: r["throughput_tok_s"])  # the batch size to serve at
    chosen = _choice(winners)
    checked = {json.dumps(r["cache"], sort_keys=True): r for r in winners.values() if r["cache"]["kind"] != "growing"}
    match = min((_same_tokens(model, r, input_len, output_len, vocab_size(model), cfg.seed)
                 for r in checked.values()), default=1.0)
    sizing = KVSizing(kv_bytes_per_token=per_token, memory_budget_mb=budget / MB, context=context,
                      max_context=max_ctx, max_batch=best["max_batch"], batch_size=best["batch_size"])
    step = kv_cache_step(chosen, sizing)  # the sizing is what opus serve sizes its pool from by default
    metrics: dict[str, Any] = {
        "kv_throughput_tok_s": best["throughput_tok_s"], "kv_peak_mem_mb": best.get("peak_mem_mb"),
        "kv_max_batch": best["max_batch"], "kv_batch_size": best["batch_size"], "kv_bytes_per_token": per_token,
        "kv_pooled": float(best["cache"]["kind"] == "pooled"), "kv_exact_match": match,
        "kv_by_batch": float(chosen["kind"] == "by_batch"),
        # the chosen caches' perplexity through the cache over the growing cache's (0: none keeps K/V narrower)
        "kv_ppl_increase": max((fidelity[_label(r["cache"])]["increase"] for r in winners.values()
                                if _label(r["cache"]) in fidelity), default=0.0)}
    for batch, row in winners.items():
        growing = [r for r in measured if r["cache"]["kind"] == "growing" and r["batch_size"] == batch]
        if growing:
            metrics[f"kv_speedup_vs_growing_b{batch}"] = row["throughput_tok_s"] / growing[0]["throughput_tok_s"]
    if f"kv_speedup_vs_growing_b{best['batch_size']}" in metrics:
        metrics["kv_speedup_vs_growing"] = metrics[f"kv_speedup_vs_growing_b{best['batch_size']}"]
    notes = compile_notes()
    for note in notes:
        ctx.log(note)
    report = KVConfigReport(chosen=chosen, sizing=sizing, candidates=rows, unavailable=unavailable,
                            winners={str(b): r["cache"] for b, r in winners.items()}, notes=notes,
                            kv_fidelity=fidelity, workload=KVWorkload(input_len=input_len, output_len=output_len,
                                                                      batch_sizes=batches, rounds=rounds))
    ctx.write_artifact(KV_CONFIG_FILE, report.model_dump(mode="json"))
    write_decisions(ctx, decisions)
    return StageResult(metrics=metrics, recipe=[step], info={"kv_cache": chosen})
