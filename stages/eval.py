"""Measure the incoming (possibly optimized) model like the baseline, plus its fidelity to it.

Fidelity compares against the reference the upstream baseline stage saved: ``agreement``
(teacher-forced greedy token agreement), ``agreement_free`` (free-running, through the engine and
its KV cache), ``logits_cosine`` and ``top5_overlap``. Keep this stage's measurement switches the
same as the baseline's so the ratios compare like with like.

Side by side (``side_by_side``, on by default when a baseline stage is upstream): the unmodified model
is loaded beside the candidate and P and D are timed in paired rounds (opus.runtime.paired); the
ratios ``<key>_paired`` (median, [low, high], noisy) are what the run's summary reports and what
gates on ratios check, at the interval's conservative end. When both models would not fit in the
memory available now (``side_by_side_mode: auto``), or when asked (``bracketed``), the candidate is
let go and the models are timed one at a time — baseline, candidate, baseline — the two baseline runs
bracketing the candidate's, with their drift reported (``opus.runtime.paired.measure_bracketed``).

Long generation (``long_generation_tokens`` > 0): the candidate and the unmodified model each generate
that many tokens greedily from the first workload prompts, through their own caches, and the unmodified
model scores both texts by segment (``long_nll``, ``long_nll_base``, ``long_nll_increase_max``:
opus.runtime.long_generation). A decode path that loses its way late shows there, where perplexity and
teacher-forced agreement never look.

Tasks (``tasks``: lm-evaluation-harness task names, or task files relative to the pipeline file, e.g. the
ones ``opus tasks`` writes): each task runs on the candidate and on the unmodified model over the same
``task_limit`` samples (opus.harness): ``task/<task>/<metric>``, ``..._base`` and ``..._drop`` with its 95 %
interval; a gate ``task_accuracy: {max_drop: 0.01}`` holds them, passing, failing or saying the sample
count cannot tell (opus.pipeline.gates).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from opus.pipeline.context import StageContext, StageResult
from opus.runtime.long_generation import METRICS as LONG_METRICS
from stages import FIDELITY_METRICS, REFERENCE, SUITE_METRICS, MeasureConfig, Measured, measure_incoming

VERSION = "1"
ROLE = "eval"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
# What a gate on this stage can name: task metrics are task/<task>/<metric>, task_accuracy all of them.
METRICS = SUITE_METRICS | FIDELITY_METRICS | LONG_METRICS | {"task/*", "task_accuracy"}


class Config(MeasureConfig):
    fidelity: bool = True  # compare with the upstream baseline's reference
    side_by_side: bool = True  # time the unmodified model beside this one for P and D ratios
    side_by_side_rounds: int = Field(5, ge=5, description="paired rounds of P and of D")
    side_by_side_mode: Literal["auto", "interleaved", "bracketed"] = Field(
        "auto", description="interleaved: both models in memory, paired rounds; bracketed: one at a time, "
                            "baseline, candidate, baseline; auto: interleaved when both fit in memory")
    long_generation_tokens: int = Field(0, ge=0, description="greedy tokens each side generates from the first "
                                                             "workload prompts, scored by the unmodified model "
                                                             "(0: off; needs a baseline stage upstream)")
    long_generation_prompts: int = Field(4, ge=1, description="prompts of the long generation")
    long_generation_segment: int = Field(64, ge=1, description="tokens per scored segment of the long generation")
    tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness tasks run on this model and "
                                                               "on the unmodified one: the harness's task names "
                                                               "(from cached datasets) or task files (.yaml, "
                                                               "relative to the pipeline file); needs a baseline "
                                                               "stage upstream and the [lmeval] extra")
    task_limit: int | None = Field(100, ge=1, description="samples per task (the same ones on both models); "
                                                          "null: every sample")
    task_batch_size: int = Field(8, ge=1, description="requests scored in one forward pass")


def preflight(cfg: Config, spec: Any, base_dir: Any = None) -> list[tuple[tuple[str, ...], str]]:
    """Tasks need the harness installed and their task files readable, before anything runs."""
    if not cfg.tasks:
        return []
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return [(("tasks",), "tasks run through lm-evaluation-harness: pip install 'opus[lmeval]'")]
    from pathlib import Path

    from opus.errors import InputError
    from opus.harness.tasks import task_entry

    problems = []
    for index, entry in enumerate(cfg.tasks):
        try:
            task_entry(entry, Path(base_dir or "."))
        except InputError as error:
            problems.append((("tasks", str(index)), str(error)))
    return problems


def _task_units(cfg: Config) -> int:
    """A task side's share of the stage's progress: its samples (a task without a limit counted as 100)."""
    return cfg.task_limit or 100


def _tasks(ctx: StageContext, cfg: Config, measured: Measured) -> dict[str, Any]:
    """Each task on the candidate, then on the unmodified model, over the same samples."""
    from opus.harness.compare import compare_scores, run_tasks, task_manager
    from opus.harness.lm import OpusLM
    from opus.harness.tasks import task_entry
    from opus.kv.cache import cache_factory
    from opus.pipeline.state import load_base

    entries = [task_entry(t, ctx.base_dir) for t in cfg.tasks]
    manager = task_manager(entries)
    loaded = measured.loaded
    base_model, tokenizer = load_base(ctx.spec, ctx.base_dir)
    scores: dict[str, dict[str, dict[str, list[float]]]] = {"candidate": {}, "unmodified": {}}
    sides = {"candidate": OpusLM.of(loaded.model, loaded.tokenizer, measured.factory, cfg.task_batch_size),
             "unmodified": OpusLM.of(base_model, tokenizer or loaded.tokenizer, cache_factory(base_model),
                                     cfg.task_batch_size)}
    for entry, name in zip(entries, cfg.tasks):
        for side, lm in sides.items():  # task by task: the progress names each and counts its samples
            what = f"task {entry['task'] if isinstance(entry, dict) else name} ({side})"
            beats = [0]  # a beat per shared-prefix sample, forward batch or generation batch: about a sample

            def beat(what: str = what, beats: list[int] = beats) -> None:
                step = 1 if beats[0] < _task_units(cfg) else 0
                beats[0] += step
                measured.progress.advance(step, what)

            lm.heartbeat = beat
            scores[side].update(run_tasks(lm, [entry], cfg.task_limit, manager=manager))
            measured.progress.advance(_task_units(cfg) - beats[0], what)
    metrics = compare_scores(scores["unmodified"], scores["candidate"])
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not key.endswith("_base"):
            base_value = metrics.get(f"{key}_base")
            drop = metrics.get(f"{key}_drop")
            span = (f", drop {drop['drop']:+.3f} [{drop['low']:+.3f}, {drop['high']:+.3f}] over {drop['n']} samples"
                    if drop else "")
            ctx.log(f"{key}: {value:.3f} (unmodified {base_value:.3f}{span})" if base_value is not None
                    else f"{key}: {value:.3f}")
    return metrics


def _long_generation(ctx: StageContext, cfg: Config, measured: Measured) -> dict[str, Any]:
    from opus.kv.cache import cache_factory
    from opus.pipeline.state import load_base
    from opus.runtime.long_generation import score_long_generation

    base_model, _ = load_base(ctx.spec, ctx.base_dir)
    prompts = measured.inputs.prompts[: cfg.long_generation_prompts]
    metrics, info = score_long_generation(
        measured.loaded.model, measured.factory, base_model, cache_factory(base_model), prompts,
        cfg.long_generation_tokens, cfg.long_generation_segment,
        on_step=lambda _: measured.progress.advance(1, "long generation"))
    measured.info["long_generation"] = info
    worst = max(info["segments"], key=lambda s: s["nll"] - s["nll_base"])
    ctx.log(f"long generation: {cfg.long_generation_tokens} tokens × {prompts.shape[0]} prompts, NLL under the "
            f"unmodified model {metrics['long_nll']:.3f} (its own text {metrics['long_nll_base']:.3f}); worst "
            f"segment {worst['tokens'][0]}-{worst['tokens'][1]}: +{worst['nll'] - worst['nll_base']:.3f}")
    return metrics


def _side_by_side(ctx: StageContext, cfg: Config, measured: Measured) -> dict[str, Any]:
    """P and D of the unmodified model and of this one, in paired rounds in this process."""
    import psutil

    from opus.kv.cache import cache_factory
    from opus.pipeline.state import load_base
    from opus.runtime.machine import describe, recorded
    from opus.runtime.metrics import model_mb
    from opus.runtime.paired import measure_paired

    keys = [k for k, on in (("throughput_tok_s", cfg.throughput), ("ttft_ms", cfg.ttft)) if on]
    if not keys or "throughput_tok_s" not in measured.metrics and "ttft_ms" not in measured.metrics:
        return {}
    need_mb = model_mb(measured.loaded.model)  # the unmodified model is at most about this big again x4
    available_mb = psutil.virtual_memory().available / (1 << 20)
    mode = cfg.side_by_side_mode
    if mode == "auto":
        fits = ctx.spec.model.device != "cpu" or 4 * need_mb <= 0.8 * available_mb
        mode = "interleaved" if fits else "bracketed"
        if not fits:
            ctx.log(f"the unmodified model may need ~{4 * need_mb:.0f} MB beside this one and {available_mb:.0f} MB "
                    "are available: timed one at a time, baseline, candidate, baseline")
    if mode == "bracketed":
        return _bracketed(ctx, cfg, measured, keys)
    base_model, _ = load_base(ctx.spec, ctx.base_dir)
    w, recorded_on = ctx.workload, {}
    with recorded(recorded_on):
        paired = measure_paired((base_model, cache_factory(base_model)), (measured.loaded.model, measured.factory),
                                measured.inputs.prompts, w.output_len, keys, cfg.side_by_side_rounds,
                                lambda what: measured.progress.advance(1, what))
    measured.info["side_by_side_machine"] = recorded_on["machine"]
    ctx.log(f"side by side on {describe(recorded_on['machine'])}")
    for key, result in paired.items():
        ctx.log(f"side by side {key.removesuffix('_paired')}: ×{result['ratio']:.3f} "
                f"[{result['low']:.3f}–{result['high']:.3f}] over {result['n']} paired rounds"
                + (" (noisy)" if result["noisy"] else ""))
    return paired


def _bracketed(ctx: StageContext, cfg: Config, measured: Measured, keys: list[str]) -> dict[str, Any]:
    """Baseline, candidate, baseline, one model in memory at a time: the candidate measured so far is let go."""
    from opus.kv.cache import cache_factory
    from opus.kv.choice import cache_config_from_recipe
    from opus.pipeline.state import load_base
    from opus.runtime.machine import recorded
    from opus.runtime.paired import measure_bracketed

    def baseline() -> tuple[Any, Any]:
        model, _ = load_base(ctx.spec, ctx.base_dir)
        return model, cache_factory(model)

    def candidate() -> tuple[Any, Any]:
        loaded = ctx.load_model()
        ctx.release_model()  # held only by the caller, which lets it go before the second baseline
        return loaded.model, cache_factory(loaded.model, cache_config_from_recipe(loaded.state.get("recipe")))

    measured.loaded, measured.factory = None, None  # nothing after this needs them
    ctx.release_model()
    recorded_on: dict[str, Any] = {}
    with recorded(recorded_on):
        bracketed = measure_bracketed(baseline, candidate, measured.inputs.prompts, ctx.workload.output_len, keys,
                                      cfg.side_by_side_rounds, lambda what: measured.progress.advance(1, what))
    measured.info["side_by_side_machine"] = recorded_on["machine"]
    for key, result in bracketed.items():
        noisy = " (noisy)" if result["noisy"] else ""
        ctx.log(f"bracketed {key.removesuffix('_paired')}: ×{result['ratio']:.3f} [{result['low']:.3f}–"
                f"{result['high']:.3f}], baseline drift {result['drift']:+.1%}{noisy}")
    return bracketed


def run(ctx: StageContext, cfg: Config) -> StageResult:
    from opus.runtime.metrics import Reference, compare_to_reference, fidelity_units

    reference = None
    baseline = next((up for up in ctx.upstream.values() if up.baseline), None)
    if cfg.fidelity:
        if baseline is None:
            ctx.log("no baseline stage upstream (add one to `needs`): fidelity metrics skipped")
        elif not baseline.artifact(REFERENCE).is_file():
            ctx.log(f"baseline stage '{baseline.id}' left no {REFERENCE}: fidelity metrics skipped")
        else:
            reference = Reference.load(baseline.artifact(REFERENCE))
    from opus.runtime.paired import paired_units

    extra = fidelity_units(reference.tokens.shape[1]) if reference is not None else 0
    side_by_side = cfg.side_by_side and baseline is not None
    extra += paired_units(["throughput_tok_s", "ttft_ms"], cfg.side_by_side_rounds) if side_by_side else 0
    long_generation = cfg.long_generation_tokens > 0 and baseline is not None
    if cfg.long_generation_tokens > 0 and baseline is None:
        ctx.log("no baseline stage upstream: long generation skipped")
    extra += 2 * cfg.long_generation_tokens if long_generation else 0
    tasks = bool(cfg.tasks) and baseline is not None
    if cfg.tasks and baseline is None:
        ctx.log("no baseline stage upstream: tasks skipped")
    extra += 2 * len(cfg.tasks) * _task_units(cfg) if tasks else 0
    measured = measure_incoming(ctx, cfg, extra_units=extra)
    if reference is not None and baseline is not None:
        measured.metrics.update(compare_to_reference(measured.loaded.model, reference, measured.factory,
                                                     measured.progress))
        measured.info["fidelity_reference"] = str(baseline.artifact(REFERENCE))
    if long_generation:  # before side by side, which may let the candidate go (bracketed)
        measured.metrics.update(_long_generation(ctx, cfg, measured))
    if tasks:
        measured.metrics.update(_tasks(ctx, cfg, measured))
    if side_by_side:
        measured.metrics.update(_side_by_side(ctx, cfg, measured))
    return StageResult(metrics=measured.metrics, info=measured.info)
