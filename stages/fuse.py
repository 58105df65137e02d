"""Fuse operators (q/k/v and gate/up GEMMs, SwiGLU, residual add + RMSNorm, grouped MoE experts).

Mechanisms live in ``opus.fusion``; this stage records the model's behaviour on fixed prompts, fuses,
checks the fused model against that record, and writes ``fusion.json`` (node and op counts before
and after, dispatch share, per-pattern fused/skipped with reasons, the ignore list).

The check is on by default: below ``check`` thresholds the stage fails loudly (the runner rolls back
and records the message). For a YAML gate with a remedy instead, set ``check.action: report`` and
gate on ``fusion_exact_match`` / ``fusion_cosine`` / ``fusion_max_abs_diff``, ``on_fail: retry``:
the remedy switches off one pattern per retry, riskiest first::

    - id: fuse
      uses: fuse
      needs: baseline
      with:
        ignore: ["model.layers.0.*", "rmsnorm"]   # module globs, class names, pattern/op names
        compile: {enabled: false}                  # measured on a decode step when enabled
        check: {action: report}
      gate: {fusion_exact_match: {min: 0.95}, fusion_cosine: {min: 0.999}}
      on_fail: retry
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from opus.errors import InputError
from opus.fusion.moe import EXPERT_MODES
from opus.fusion.rewrite import FUSION_FILE
from opus.pipeline.context import StageContext, StageResult
from opus.pipeline.contracts import Failure
from opus.pipeline.replay import source_artifact
from opus.runtime.timed_choice import DEFAULT_ROUNDS, write_decisions

VERSION = "1"
ROLE = "transform"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = frozenset({f"{count}_{when}" for when in ("before", "after") for count in
                     ("nodes", "ops", "ops_prefill", "ops_decode", "decode_ms", "dispatch_share")}
                    | {"fusion_exact_match", "fusion_cosine", "fusion_cosine_min", "fusion_max_abs_diff",
                       "fusion_check_passed", "sites_fused", "sites_skipped", "regions_ignored",
                       "compile_kept", "decode_ms_eager", "decode_ms_compiled"})
ALL_PATTERNS = ["qkv", "gate_up", "linear_group", "silu_mul", "add_rmsnorm", "rmsnorm", "moe_grouped"]
RISK_ORDER = ["moe_grouped", "add_rmsnorm", "rmsnorm", "silu_mul", "linear_group", "gate_up", "qkv"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Check(Strict):
    min_exact_match: float | None = 0.95
    min_cosine: float | None = 0.999
    max_abs_diff: float | None = None
    action: Literal["raise", "report"] = "raise"


class Compile(Strict):
    enabled: bool = False  # measured: kept only when a decode step gets faster beyond the noise (timed_choice)
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    rounds: int = Field(DEFAULT_ROUNDS, ge=1)  # interleaved eager/compiled timing rounds


class Experts(Strict):
    """The grouped MoE's execution mode per phase (opus.fusion.moe), measured on the pipeline's device."""
    choose: bool = True  # False: the default modes (sorted), nothing timed
    modes: list[str] = Field(default_factory=lambda: list(EXPERT_MODES))
    rounds: int = Field(DEFAULT_ROUNDS, ge=1)  # interleaved timing rounds per phase
    decode_batch: int | None = Field(None, gt=0)  # rows of the timed decode step; None: the workload's batch
    # The timed prefill: prompts of this batch and length (None: the workload's), the text repeated to fit.
    prefill_batch: int | None = Field(None, gt=0)
    prefill_len: int | None = Field(None, gt=1)


class Config(Strict):
    patterns: list[str] = Field(default_factory=lambda: list(ALL_PATTERNS))
    ignore: list[str] = Field(default_factory=list)  # module-name globs, class names, pattern/op names
    tolerance: float | None = None  # per-region relative max diff; None: 1e-4 fp32, 2e-2 16-bit
    prompts: int = Field(2, gt=0)
    prompt_len: int = Field(32, gt=1)
    new_tokens: int = Field(16, gt=0)
    probe_len: int = Field(8, gt=0)  # tokens of the probe that checks each rewrite on the spot
    seed: int = 0
    measure_time: bool = True  # decode-step wall time and the dispatch share estimate
    compile: Compile = Field(default_factory=Compile)
    experts: Experts = Field(default_factory=Experts)
    check: Check = Field(default_factory=Check)


def _lm_prompts(ctx: StageContext, model: Any, tokenizer: Any, cfg: Config) -> tuple[Any, str, Any]:
    """(the prompts, where they came from, every evaluation block they were cut from: the text that the
    experts' prefill timing repeats to the workload's shape)."""
    from opus.runtime.data import DataError, load_blocks, random_blocks
    from opus.runtime.metrics import vocab_size

    evaluation = ctx.spec.data.evaluation
    if evaluation is not None and tokenizer is not None:
        try:
            blocks = load_blocks(evaluation, tokenizer, ctx.base_dir)
            if blocks.shape[0] >= cfg.prompts and blocks.shape[1] >= cfg.prompt_len:
                return blocks[: cfg.prompts, : cfg.prompt_len].clone(), "text", blocks
        except DataError as exc:
            ctx.log(f"fusion prompts are random token ids: {exc}")
    prompts = random_blocks(cfg.prompts, cfg.prompt_len, vocab_size(model), cfg.seed)
    return prompts, "random", prompts


def _generic_inputs(model: Any, cfg: Config) -> tuple[Any, ...]:
    """A probe for a module outside Opus's LM interface: ids for an embedding, floats for a linear."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(cfg.seed)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return (torch.randint(0, module.num_embeddings, (cfg.prompts, cfg.prompt_len), generator=g),)
        if isinstance(module, nn.Linear):
            return (torch.randn(cfg.prompts, module.in_features, generator=g).to(module.weight),)
    raise InputError(f"cannot make a probe input for {type(model).__name__}: no Embedding or Linear")


def _counts(fusion: Any, model: Any, ids: Any, lm: bool, timed: bool) -> dict[str, Any]:
    nodes, regions = fusion.region_nodes(model)
    out: dict[str, Any] = {"nodes": nodes, "regions": regions}
    if lm:
        ops = fusion.lm_op_counts(model, ids)
        out.update(ops=ops["prefill"] + ops["decode"], ops_prefill=ops["prefill"], ops_decode=ops["decode"])
        if timed:
            step = fusion.decode_step_s(model, ids)
            out.update(decode_ms=step * 1e3, dispatch_share=fusion.dispatch_share(ops["decode"], step,
                                                                                  fusion.trivial_op_s(ids.device)))
    return out


def _check(cfg: Check, eq: dict[str, float]) -> list[str]:
    failures = []
    if cfg.min_exact_match is not None and not eq["fusion_exact_match"] >= cfg.min_exact_match:
        failures.append(f"fusion_exact_match {eq['fusion_exact_match']:.4f} < {cfg.min_exact_match}")
    if cfg.min_cosine is not None and not eq["fusion_cosine"] >= cfg.min_cosine:
        failures.append(f"fusion_cosine {eq['fusion_cosine']:.6f} < {cfg.min_cosine}")
    if cfg.max_abs_diff is not None and not eq["fusion_max_abs_diff"] <= cfg.max_abs_diff:
        failures.append(f"fusion_max_abs_diff {eq['fusion_max_abs_diff']:.3g} > {cfg.max_abs_diff}")
    return failures


def run(ctx: StageContext, cfg: Config) -> StageResult:
    from opus import fusion
    from opus.runtime.engine import model_device, supports_cache

    loaded = ctx.load_model()
    model = loaded.model
    lm = supports_cache(model)
    ctx.progress(0, 4, "recording the reference")
    if lm:
        prompts, source, text = _lm_prompts(ctx, model, loaded.tokenizer, cfg)
        prompts = prompts.to(model_device(model))
        reference = fusion.lm_reference(model, prompts, cfg.new_tokens)
        probe, count_ids = fusion.lm_probe(prompts[:1, : cfg.probe_len]), prompts[:1]
    else:
        inputs, source = _generic_inputs(model, cfg), "random"
        reference = fusion.generic_reference(model, inputs)
        probe, count_ids = fusion.call_probe(*inputs), None
    before = _counts(fusion, model, count_ids, lm, cfg.measure_time)
    ctx.progress(1, 4, "fusing")
    outcome = fusion.fuse_model(model, fusion.FusionConfig(cfg.patterns, cfg.ignore, cfg.tolerance), probe)
    model = outcome.model
    experts = _expert_modes(ctx, model, cfg, (prompts, text) if lm else None)
    ctx.progress(2, 4, "checking equivalence")
    eq = fusion.compare(model, reference)
    after = _counts(fusion, model, count_ids, lm, cfg.measure_time)
    compiled = None
    if cfg.compile.enabled and lm:
        settings = cfg.compile.model_dump(exclude={"enabled", "rounds"})
        replay = source_artifact(ctx, FUSION_FILE)  # run.decisions_from: that run's compile choice
        if replay is not None:
            record = json.loads(replay.read_text()).get("compile")
            compiled = fusion.replay_compile(model, record, settings, str(replay))
        else:
            ctx.progress(3, 4, "measuring torch.compile")
            compiled = fusion.decide_compile(model, count_ids, settings, rounds=cfg.compile.rounds)
    decisions = ([compiled.choice] if compiled and compiled.choice else []) + (experts.decisions if experts else [])
    if decisions or compiled is not None:
        write_decisions(ctx, decisions)
    step = outcome.step(compiled.settings if compiled and compiled.kept else None,
                        experts.modes if experts else None)
    metrics: dict[str, Any] = {f"{k}_{when}": v for when, d in (("before", before), ("after", after))
                               for k, v in d.items() if k != "regions"}
    metrics.update(eq, sites_fused=len(outcome.sites), sites_skipped=len(outcome.skipped),
                   regions_ignored=len(outcome.ignored))
    if compiled is not None:
        metrics["compile_kept"] = float(compiled.kept)
        for key, value in (("decode_ms_eager", compiled.eager_ms), ("decode_ms_compiled", compiled.compiled_ms)):
            if value is not None:  # a replayed choice times nothing
                metrics[key] = value
    failures = _check(cfg.check, eq)
    metrics["fusion_check_passed"] = float(not failures)
    report = {
        "patterns": outcome.patterns(), "ignored": outcome.ignored, "sites": step.sites,
        **{k: metrics[k] for k in sorted(metrics) if k.endswith(("_before", "_after"))},
        "regions_traced": {"before": before["regions"], "after": after["regions"]},
        "equivalence": {**eq, "prompts": source, "shape": list(reference_shape(reference)),
                        "check": cfg.check.model_dump(), "failures": failures},
        "compile": None if compiled is None else compiled.record(),
        "experts": None if experts is None else experts.record(),
        "how": {"nodes": "fx call nodes summed over traced regions (getitem/getattr excluded)",
                "ops": "aten ops seen by a TorchDispatchMode: one prefill of the first prompt + one decode step",
                "dispatch_share": "ops per decode step x time of a 1-element add, over the decode step's "
                                  "wall time (a floor: module-call overhead not included)"},
    }
    ctx.write_artifact(FUSION_FILE, report)
    if failures and cfg.check.action == "raise":
        raise RuntimeError("fusion changed the model's outputs: " + "; ".join(failures)
                           + " (fusion.json lists every rewrite; ignore a pattern or module to exclude it)")
    return StageResult(metrics=metrics, model=model, recipe=[step], info={"prompts": source})


def _expert_modes(ctx: StageContext, model: Any, cfg: Config, prompts_and_text: tuple[Any, Any] | None) -> Any:
    """The grouped MoE's modes: measured here, replayed from ``run.decisions_from``, or the default.
    Modes this device cannot run are listed with the reason in fusion.json, never dropped silently."""
    from opus.fusion.expert_modes import decide_expert_modes, replay_expert_modes
    from opus.fusion.moe import grouped_moes
    from opus.runtime.data import tiled

    if prompts_and_text is None or not cfg.experts.choose or not grouped_moes(model):
        return None
    prompts, text = prompts_and_text
    replay, timed = source_artifact(ctx, FUSION_FILE), ""
    if replay is not None:
        record = json.loads(replay.read_text()).get("experts")
        choice = replay_expert_modes(model, record, str(replay))
    else:
        ctx.progress(1.5, 4, "measuring the MoE experts modes")
        workload = ctx.spec.workload
        batch = cfg.experts.decode_batch or workload.batch_size
        shape = (cfg.experts.prefill_batch or workload.batch_size, cfg.experts.prefill_len or workload.input_len)
        prefill = tiled(text, *shape).to(prompts.device)
        choice = decide_expert_modes(model, prompts, batch, tolerance=cfg.tolerance, rounds=cfg.experts.rounds,
                                     wanted=cfg.experts.modes, prefill=prefill)
        timed = f" (prefill timed at batch {shape[0]} × {shape[1]} tokens)"
    if choice is not None:
        for mode, why in choice.unavailable.items():
            ctx.log(f"MoE experts mode {mode} not measured: {why}")
        ctx.log(f"MoE experts modes: {choice.modes}{timed}")
    return choice


def reference_shape(reference: Any) -> tuple[int, ...]:
    inputs = reference.inputs
    return tuple(inputs.shape) if hasattr(inputs, "shape") else ()


def remedy(cfg: Config, failure: Failure) -> Config | None:
    """After a failed gate on a fusion metric: switch off the riskiest pattern still on."""
    if not (failure.metric or "").startswith("fusion_"):
        return None
    for pattern in RISK_ORDER:
        if pattern in cfg.patterns:
            return cfg.model_copy(update={"patterns": [p for p in cfg.patterns if p != pattern]})
    return None
