"""PyTorch contenders: Opus's decoder through Opus's engine, as loaded or transformed.

Each loads its own copy of the model from the pipeline's source, so no contender's memory figure
includes another's model.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from opus.bench.core import BenchContext, Built, Contender, Unavailable
from opus.kv.cache import cache_factory, describe_cache
from opus.kv.choice import cache_config_from_recipe
from opus.runtime.engine import full_logits, generate

if TYPE_CHECKING:
    from opus.quant.calibrate import ActivationStats


def _on_cpu(ctx: BenchContext, what: str) -> None:
    if not ctx.device.startswith("cpu"):
        raise Unavailable(f"{what} runs on CPU only; this pipeline's model is on {ctx.device}")


def fp32(ctx: BenchContext) -> Built:
    model = ctx.load("float32")
    return Built(model, cache_factory(model), ["Opus decoder, float32 eager, growing KV cache (torch.cat)"])


def bf16(ctx: BenchContext) -> Built:
    model = ctx.load("bfloat16")
    return Built(model, cache_factory(model), ["every weight, activation and the KV cache in bfloat16"])


def torch_int8_dynamic(ctx: BenchContext) -> Built:
    _on_cpu(ctx, "torch.ao dynamic quantization")
    engines = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    if not engines:
        raise Unavailable("this torch build has no quantized CPU engine (fbgemm/x86/qnnpack)")
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as exc:
        raise Unavailable(f"torch.ao.quantization is missing from this torch: {exc}") from None
    model = ctx.load("float32")
    with warnings.catch_warnings():  # torch.ao is deprecated in favour of torchao; it still runs
        warnings.simplefilter("ignore")
        model = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    swapped = sum(1 for m in model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear))
    notes = [f"torch.ao.quantization.quantize_dynamic on every nn.Linear ({swapped} swapped, routers and "
             f"lm_head included): int8 weights per tensor, activations quantized per tensor at run time; "
             f"engine {torch.backends.quantized.engine}"]
    return Built(model, cache_factory(model), notes, {"model_mb": state_mb(model)})


def state_mb(model: nn.Module) -> float:
    """Bytes of the state dict, packed int8 weights included (they are neither parameters nor buffers)."""
    seen: set[int] = set()
    total = 0
    stack = list(model.state_dict().values())
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            total += value.numel() * value.element_size()
    return total / 2**20


def _stage_options(ctx: BenchContext, uses: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The options ``keys`` the pipeline gives its first ``uses`` stage; a key it leaves out is left out
    here too, so the mechanism's default applies, as it does in the stage (opus never imports stages)."""
    stage = next((s for s in ctx.spec.stages if s.uses == uses), None) if ctx.spec is not None else None
    return {k: v for k, v in (stage.with_ if stage else {}).items() if k in keys}


def calibration(ctx: BenchContext, model: nn.Module) -> tuple[ActivationStats, str]:
    """Activation statistics of the float model as the plan stage collects them for quantize: on
    data.calibration (else data.evaluation) with the plan stage's percentile; once per bench."""
    if "calibration" in ctx.shared:
        return ctx.shared["calibration"]
    from opus.quant.calibrate import collect_stats
    from opus.runtime.data import load_blocks

    data = ctx.spec.data if ctx.spec is not None else None
    declared = [] if data is None else [(t, w) for t, w in ((data.calibration, "data.calibration"),
                                                            (data.evaluation, "data.evaluation")) if t is not None]
    if not declared:
        raise Unavailable("SmoothQuant calibrates on text: the pipeline declares no data.calibration or "
                          "data.evaluation")
    text_set, where = declared[0]
    blocks = load_blocks(text_set, ctx.tokenizer, ctx.base_dir)
    options = _stage_options(ctx, "plan", ("percentile",))
    stats = collect_stats(model, blocks, **options)
    what = f"{blocks.shape[0]} blocks × {blocks.shape[1]} tokens of {where}, percentile {stats.percentile}"
    ctx.shared["calibration"] = (stats, what)
    return ctx.shared["calibration"]


def _uniform(fmt: str) -> Callable[[BenchContext], Built]:
    """Every decoder linear in one registered format, quantized as the quantize stage does: a format
    that smooths (``Format.smoothquant``) gets SmoothQuant from calibration statistics first."""

    def build(ctx: BenchContext) -> Built:
        from opus.quant.apply import quantize_model
        from opus.quant.formats import check_format
        from opus.quant.groups import uniform_assignment

        try:
            found = check_format(fmt, ctx.device)
        except ValueError as exc:
            raise Unavailable(str(exc)) from None
        model = ctx.load("float32")
        assignment, skipped = uniform_assignment(model, fmt, ctx.group_size)
        if not assignment:
            raise Unavailable(f"no layer fits the {fmt} kernel: {next(iter(skipped.values()), 'no linear layers')}")
        notes: list[str] = []
        stats = None
        if found.smoothquant:  # statistics of the float model, before any layer is replaced
            stats, what = calibration(ctx, model)
            notes.append(f"calibrated on {what}")
        step = quantize_model(model, assignment, stats, group_size=ctx.group_size,
                              **_stage_options(ctx, "quantize", ("alpha",)))
        size = f", group size {ctx.group_size}" if found.uses_group_size else ""
        notes.insert(0, f"opus.quant {fmt} on {len(assignment)} linears{size}; routers and a tied lm_head stay "
                        "float32")
        if step.smoothing_alpha:
            alphas = sorted(set(step.smoothing_alpha.values()))
            notes.append(f"SmoothQuant on {len(step.smoothing_alpha)} activations, alpha {alphas}")
        elif found.acts_quantized:
            notes.append("activations quantized as they come, no smoothing")
        rows = getattr(found.module, "WEIGHT_ONLY_MAX_ROWS", None)  # a kernel that skips int8 activations
        if found.acts_quantized and rows:
            notes.append(f"inputs of at most {rows} rows (decode steps) run the int8 weights with float "
                         "activations")
        if skipped:
            notes.append(f"{len(skipped)} layers kept float32: {next(iter(skipped.values()))}")
        return Built(model, cache_factory(model), notes)

    return build


def find_cxx() -> str | None:
    """The C++ compiler inductor's CPU backend would use, or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compiled(ctx: BenchContext) -> Built:
    if ctx.device.startswith("cpu") and find_cxx() is None:
        raise Unavailable("torch.compile (inductor) needs a C++ compiler on CPU; none found (g++, c++, clang++)")
    if not ctx.device.startswith("cpu") and not torch.cuda.is_available():
        raise Unavailable(f"no CUDA device for {ctx.device}")
    model = ctx.load("float32")
    # In place, so the engine still sees the LM's forward signature. dynamic=True: the growing KV
    # cache changes length every step. Batch sizes, prefill/decode and cache-less calls still make
    # more variants than dynamo's default limit of 8, past which it silently runs eagerly.
    config = torch._dynamo.config
    limit = config.recompile_limit
    config.recompile_limit = RECOMPILE_LIMIT
    watcher = _LimitWatcher()
    logging.getLogger("torch._dynamo").addHandler(watcher)
    notes: list[str] = []

    def close() -> None:
        config.recompile_limit = limit
        logging.getLogger("torch._dynamo").removeHandler(watcher)
        torch._dynamo.reset()
        if watcher.hits:
            notes.append(f"dynamo hit its recompile limit: {watcher.hits[0]}; those calls ran eagerly")

    model.compile(dynamic=True)
    # Compilation happens on first use of each shape: pay it here, timed, not inside P or D.
    started = time.perf_counter()
    try:
        prompts, new = ctx.inputs.prompts, ctx.workload.output_len
        generate(model, prompts, new)
        generate(model, prompts[:1], new)
        if ctx.inputs.eval_blocks is not None:
            full_logits(model, ctx.inputs.eval_blocks[: ctx.settings.eval_batch_size])
    except BaseException:
        close()
        raise
    compile_s = time.perf_counter() - started
    notes.append(f"torch.compile (inductor, dynamic=True, recompile limit {RECOMPILE_LIMIT}) of the float32 "
                 f"model: {compile_s:.1f} s to compile and run each shape once (prefill, decode, batch 1, "
                 "perplexity), outside P and D")
    return Built(model, cache_factory(model), notes, {"compile_s": compile_s}, close=close)


RECOMPILE_LIMIT = 64


class _LimitWatcher(logging.Handler):
    """Collects dynamo's "hit config.recompile_limit" warnings: past it, a compiled model runs eagerly."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message:
            self.hits.append(message.splitlines()[0][:200])


def opus_run(ctx: BenchContext) -> Built:
    from opus.pipeline.state import materialize

    if ctx.checkpoint is None:
        raise Unavailable(ctx.no_run_reason or "no Opus run given")
    loaded = materialize(ctx.checkpoint, ctx.spec, ctx.base_dir)
    recipe = loaded.state.get("recipe") or []
    config = cache_config_from_recipe(recipe)
    kinds = ", ".join(step.get("kind", "?") for step in recipe) or "none"
    notes = [f"final model of {ctx.checkpoint.parent.parent.name} (checkpoint {ctx.checkpoint.name}); "
             f"recipe: {kinds}; KV cache {describe_cache(config)}"]
    return Built(loaded.model.eval(), cache_factory(loaded.model, config), notes, close=lambda: _compile_notes(notes))


def _compile_notes(notes: list[str]) -> None:
    """A static cache that could not compile its decode step ran it eagerly: the row says so."""
    from opus.kv.compiled_steps import compile_notes

    notes.extend(n for n in compile_notes() if n not in notes)


CONTENDERS = (
    Contender("fp32", "fp32 eager (baseline)", "torch", fp32),
    Contender("bf16", "bf16 eager", "torch", bf16),
    Contender("torch-int8", "torch.ao dynamic int8", "torch", torch_int8_dynamic),
    Contender("w8a16", "Opus W8A16 (int8 weights)", "torch", _uniform("w8a16")),
    Contender("w4a16", "Opus W4A16 (int4 weights)", "torch", _uniform("w4a16")),
    Contender("w8a8", "Opus W8A8 SmoothQuant (per-token int8 activations)", "torch", _uniform("w8a8")),
    Contender("w8a8-tensor", "Opus W8A8 naive (per-tensor int8 activations)", "torch", _uniform("w8a8_tensor")),
    Contender("compile", "torch.compile fp32", "torch", compiled),
)
OPUS_RUN = Contender("opus", "Opus run's final model", "torch", opus_run)
