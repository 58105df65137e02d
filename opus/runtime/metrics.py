"""What Opus measures: speed (P, D), peak memory, quality and fidelity against the baseline.

- P (``throughput_tok_s``): generated tokens per second of the workload — ``batch_size`` prompts of
  ``input_len`` tokens, ``output_len`` new tokens each, over the whole request (prefill included).
- D (``ttft_ms``): time to first token of one request of ``input_len`` tokens (prefill + first token),
  the median of at least ``TTFT_SAMPLES`` requests.
- Peak memory (``peak_mem_mb``): on CUDA the allocator's peak; on CPU the process's peak RSS while
  the batch workload runs (the kernel's high-water mark, reset first; RSS sampled in a thread where
  the kernel does not allow the reset). Measured on the first timed run, after a warm-up, so one-time
  work (compiling, first-touch allocations) is not counted.
- Quality: perplexity and next-token top-1 accuracy on evaluation blocks.
- Fidelity on fixed prompts: ``agreement`` is teacher-forced — on the baseline's own greedy
  continuation, the fraction of positions where the candidate's argmax equals the baseline's;
  ``agreement_free`` is free-running — the candidate generates greedily through the engine (and its
  KV cache) and each token is compared with the baseline's at the same position, so one early
  divergence costs everything after it. ``logits_cosine`` and ``top5_overlap`` are means over the
  teacher-forced positions.

Timings: at least one warm-up run (compiling a decode step must not land in a speed metric), then
``repeats`` runs; the median is reported and ``<key>_spread`` keeps min, median, max and count of the
repeats (see opus.runtime.noise). Long loops report progress.
"""

from __future__ import annotations

import math
import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opus.kv.cache import CacheFactory
from opus.runtime.data import DataError, cut_blocks, random_blocks, token_stream
from opus.runtime.engine import full_logits, generate, model_device
from opus.runtime.machine import recorded
from opus.runtime.noise import spread, spread_key

ProgressFn = Callable[..., None]  # (done, total, what) — StageContext.progress
MB = 1 << 20


class Progress:
    """Counts units of work (forward passes) across phases; reports at most every ``interval_s``."""

    def __init__(self, report: ProgressFn | None = None, interval_s: float = 0.5) -> None:
        self.report, self.interval_s = report, interval_s
        self.done, self.total, self.what = 0.0, 0.0, ""
        self._last = 0.0

    def expect(self, units: float) -> None:
        self.total += units

    def advance(self, units: float = 1, what: str | None = None) -> None:
        self.done += units
        changed = what is not None and what != self.what
        self.what = what if what is not None else self.what
        now = time.monotonic()
        if self.report and (changed or now - self._last >= self.interval_s):
            self._last = now
            self.report(self.done, self.total or None, self.what)


# -- memory -------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_high_water_mark() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM, so the kernel tracks the peak from now on."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _high_water_mark_bytes() -> int:
    with open("/proc/self/status") as fh:
        found = re.search(r"VmHWM:\s+(\d+)\s+kB", fh.read())
    return int(found.group(1)) * 1024 if found else 0


class PeakMemory:
    """Peak memory while the ``with`` block runs; ``peak_mb``, ``rise_mb`` and ``method`` after it."""

    def __init__(self, device: torch.device | str = "cpu", sample_s: float = 0.002) -> None:
        self.device, self.sample_s = torch.device(device), sample_s
        self.before = self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before, self.method = torch.cuda.memory_allocated(self.device), "cuda_allocator"
            return self
        self.before = _rss_bytes()
        if _reset_high_water_mark():
            self.method = "rss_high_water_mark"
        else:  # sample instead: may miss a spike shorter than sample_s
            self.method, self.peak = "rss_sampled", self.before
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_s):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        if self.method == "cuda_allocator":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())
        else:
            self.peak = _high_water_mark_bytes()

    @property
    def peak_mb(self) -> float:
        return self.peak / MB

    @property
    def rise_mb(self) -> float:
        return max(0, self.peak - self.before) / MB


def model_mb(model: nn.Module) -> float:
    """Bytes of parameters and buffers (shared storages counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        key = (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total / MB


# -- speed --------------------------------------------------------------------------------------
def measure_throughput(model: nn.Module, prompts: torch.Tensor, output_len: int, factory: CacheFactory,
                       warmup: int = 1, repeats: int = 3, progress: Progress | None = None) -> dict[str, Any]:
    """P for a batch of prompts, plus the peak memory of the first timed run.

    At least one warm-up run comes first, so one-time work (a compiled decode step's compilation,
    first-touch allocations) lands in neither the memory figure nor P.
    """
    progress = progress or Progress()

    def run(what: str) -> Any:
        return generate(model, prompts, output_len, factory, on_step=lambda _: progress.advance(1, what))

    for _ in range(max(1, warmup)):
        run("P warm-up")
    memory = PeakMemory(model_device(model))
    with memory:
        runs = [run("P")]
    runs += [run("P") for _ in range(repeats - 1)]
    return {**memory_figures(memory), **throughput_figures(runs, output_len)}


def memory_figures(memory: PeakMemory) -> dict[str, Any]:
    return {"peak_mem_mb": memory.peak_mb, "peak_mem_rise_mb": memory.rise_mb, "peak_mem_method": memory.method}


def throughput_figures(runs: list[Any], output_len: int) -> dict[str, Any]:
    """P figures of timed batch runs (GenerationResults): medians, each with its spread."""
    out = _timed("throughput_tok_s", [r.tok_s for r in runs])
    out.update(_timed("prefill_ms_batch", [r.ttft_s * 1000 for r in runs]))  # the whole batch's prefill
    if output_len > 1:
        out.update(_timed("decode_tok_s_batch", [r.decode_tok_s for r in runs]))
    return out


def _timed(key: str, values: list[float]) -> dict[str, Any]:
    """A timed metric: the median of its repeats under ``key``, their spread beside it."""
    return {key: statistics.median(values), spread_key(key): spread(values)}


# A prefill is short and the machine's noise is not: D takes the median of at least this many.
TTFT_SAMPLES = 9


def measure_latency(model: nn.Module, prompt: torch.Tensor, output_len: int, factory: CacheFactory,
                    warmup: int = 1, repeats: int = 3, progress: Progress | None = None) -> dict[str, Any]:
    """D (ms) of a single request and, when ``output_len > 1``, its decode speed at batch 1.

    At least one warm-up request comes first, as for P: batch 1 may run other code than the batch
    (a decode step compiled per batch size), and its one-time compilation must not land in D or
    ``decode_tok_s``. D is the median of ``max(repeats, TTFT_SAMPLES)`` first tokens: the full
    requests' first tokens and, when those are fewer, extra one-token requests (cheap: a prefill each).
    """
    progress = progress or Progress()
    warmup = max(1, warmup)
    runs = []
    for index in range(warmup + repeats):
        what = "D warm-up" if index < warmup else "D"
        result = generate(model, prompt[:1], output_len, factory, on_step=lambda _, w=what: progress.advance(1, w))
        if index >= warmup:
            runs.append(result)
    ttfts = [r.ttft_s * 1000 for r in runs]
    for _ in range(TTFT_SAMPLES - len(ttfts)):
        ttfts.append(generate(model, prompt[:1], 1, factory).ttft_s * 1000)
        progress.advance(1, "D")
    out = _timed("ttft_ms", ttfts)
    if output_len > 1:
        out.update(_timed("decode_tok_s", [r.decode_tok_s for r in runs]))
    return out


# -- quality ------------------------------------------------------------------------------------
def evaluate_lm(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4,
                progress: Progress | None = None) -> dict[str, float]:
    """Perplexity and top-1 accuracy of next-token prediction over every position of every block."""
    progress = progress or Progress()
    nll, correct, count = 0.0, 0, 0
    for start in range(0, blocks.shape[0], batch_size):
        batch = blocks[start : start + batch_size].to(model_device(model))
        logits = full_logits(model, batch)[:, :-1].float()
        targets = batch[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        correct += int((logits.argmax(dim=-1) == targets).sum())
        count += targets.numel()
        progress.advance(1, "perplexity")
    return {"perplexity": math.exp(nll / count), "top1_accuracy": correct / count, "eval_tokens": count}


# -- fidelity -----------------------------------------------------------------------------------
@dataclass
class Reference:
    """The baseline's behaviour on fixed prompts, saved so eval need not re-run the baseline."""

    prompts: torch.Tensor  # [n, P]
    tokens: torch.Tensor  # [n, N] greedy continuation (free-running, through the engine)
    logits: torch.Tensor  # [n, N, V] teacher-forced logits on prompts + tokens[:, :-1]
    top5: torch.Tensor  # [n, N, 5] from the fp32 logits; top5[..., 0] is the argmax

    @property
    def inputs(self) -> torch.Tensor:
        return torch.cat((self.prompts, self.tokens[:, :-1]), dim=1)

    def save(self, path: Path, max_fp32_mb: float = 32) -> Path:
        from safetensors.torch import save_file

        logits = self.logits.float()
        if logits.numel() * 4 > max_fp32_mb * MB:  # big vocabularies: half the bytes, cosine barely moves
            logits = logits.half()
        tensors = {"prompts": self.prompts, "tokens": self.tokens, "logits": logits, "top5": self.top5}
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
        return path

    @classmethod
    def load(cls, path: Path) -> Reference:
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls(prompts=t["prompts"], tokens=t["tokens"], logits=t["logits"].float(), top5=t["top5"])


def _teacher_forced(model: nn.Module, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits predicting each of ``tokens`` given the prompt and the tokens before it ([n, N, V])."""
    inputs = torch.cat((prompts, tokens[:, :-1]), dim=1)
    return full_logits(model, inputs)[:, prompts.shape[1] - 1 :].float().cpu().contiguous()


def make_reference(model: nn.Module, prompts: torch.Tensor, new_tokens: int, factory: CacheFactory,
                   progress: Progress | None = None) -> Reference:
    progress = progress or Progress()
    result = generate(model, prompts, new_tokens, factory, on_step=lambda _: progress.advance(1, "reference"))
    tokens = result.tokens.cpu()
    logits = _teacher_forced(model, prompts, tokens)
    progress.advance(1, "reference")
    top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
    return Reference(prompts=prompts.cpu(), tokens=tokens, logits=logits, top5=top5)


def compare_to_reference(model: nn.Module, ref: Reference, factory: CacheFactory,
                         progress: Progress | None = None) -> dict[str, float]:
    """Fidelity of ``model`` to the baseline that produced ``ref`` (1.0 everywhere for the same model)."""
    progress = progress or Progress()
    logits = _teacher_forced(model, ref.prompts, ref.tokens)
    if logits.shape != ref.logits.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} differs from the baseline's "
                         f"{tuple(ref.logits.shape)}: not the same vocabulary?")
    progress.advance(1, "fidelity")
    free = generate(model, ref.prompts, ref.tokens.shape[1], factory,
                    on_step=lambda _: progress.advance(1, "fidelity")).tokens.cpu()
    top5 = logits.topk(ref.top5.shape[-1], dim=-1).indices
    overlap = (top5[..., :, None] == ref.top5[..., None, :]).any(dim=-1).sum(dim=-1).float() / top5.shape[-1]
    return {
        # Argmax as topk's first index on both sides: ties break the same way, and the fp32 choice
        # is kept even when the saved logits are fp16.
        "agreement": (top5[..., 0] == ref.top5[..., 0]).float().mean().item(),
        "agreement_free": (free == ref.tokens).float().mean().item(),
        "logits_cosine": F.cosine_similarity(logits, ref.logits, dim=-1).mean().item(),
        "top5_overlap": overlap.mean().item(),
    }


def fidelity_units(new_tokens: int) -> int:
    """Progress units of make_reference / compare_to_reference."""
    return new_tokens + 1


# -- the suite the baseline and eval stages share -------------------------------------------------
@dataclass
class Settings:
    throughput: bool = True
    ttft: bool = True
    decode_batch1: bool = True  # D runs generate output_len tokens, also giving decode_tok_s at batch 1
    quality: bool = True
    eval_batch_size: int = 4


@dataclass
class Inputs:
    prompts: torch.Tensor  # [batch_size, input_len] for P; row 0 is D's request
    eval_blocks: torch.Tensor | None
    prompt_source: str  # "text" or "random"


def vocab_size(model: nn.Module) -> int:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(size, int):
        raise ValueError(f"{type(model).__name__} has no config.vocab_size; cannot make random prompts")
    return size


def prepare_inputs(model: nn.Module, tokenizer: Any, workload: Any, evaluation: Any, base_dir: Path,
                   log: Callable[[str], None] = print) -> Inputs:
    """Workload prompts from the evaluation text when it is long enough, else seeded random ids."""
    batch, length = workload.batch_size, workload.input_len
    if evaluation is None:
        return Inputs(random_blocks(batch, length, vocab_size(model)), None, "random")
    stream, where = token_stream(evaluation, tokenizer, base_dir)
    blocks = cut_blocks(stream, evaluation.samples, evaluation.seq_len, evaluation.seed, where)
    try:
        return Inputs(cut_blocks(stream, batch, length, evaluation.seed, where), blocks, "text")
    except DataError as exc:
        log(f"workload prompts are random token ids: {exc}")
        return Inputs(random_blocks(batch, length, vocab_size(model)), blocks, "random")


def fidelity_prompts(model: nn.Module, inputs: Inputs, count: int, length: int) -> tuple[torch.Tensor, str]:
    """The first ``length`` tokens of the first ``count`` evaluation blocks, else seeded random ids."""
    blocks = inputs.eval_blocks
    if blocks is not None and blocks.shape[0] >= count and blocks.shape[1] >= length:
        return blocks[:count, :length].clone(), "text"
    return random_blocks(count, length, vocab_size(model), seed=1), "random"


def suite_units(settings: Settings, workload: Any, eval_samples: int) -> int:
    runs = max(1, workload.warmup) + workload.repeats  # P and D both warm up at least once
    units = runs * workload.output_len if settings.throughput else 0
    if settings.ttft:
        units += runs * (workload.output_len if settings.decode_batch1 else 1)
        units += max(0, TTFT_SAMPLES - workload.repeats)
    units += math.ceil(eval_samples / settings.eval_batch_size) if settings.quality else 0
    return units


def measure_suite(model: nn.Module, inputs: Inputs, workload: Any, settings: Settings,
                  factory: CacheFactory, progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """P, D, memory and quality of ``model`` under ``workload``: (metrics, info about how)."""
    progress = progress or Progress()
    progress.expect(suite_units(settings, workload, 0 if inputs.eval_blocks is None else len(inputs.eval_blocks)))
    metrics: dict[str, Any] = {"model_mb": model_mb(model)}
    info: dict[str, Any] = {}
    with recorded(info):  # every speed figure says what machine, and how busy, it was measured on
        _measure_into(metrics, model, inputs, workload, settings, factory, progress)
    info.update({"prompt_source": inputs.prompt_source, "device": str(model_device(model)),
                 "threads": torch.get_num_threads(), "torch": torch.__version__})
    if "peak_mem_method" in metrics:
        info["memory_method"] = metrics.pop("peak_mem_method")
    return metrics, info


def _measure_into(metrics: dict[str, Any], model: nn.Module, inputs: Inputs, workload: Any, settings: Settings,
                  factory: CacheFactory, progress: Progress) -> None:
    if settings.throughput:
        metrics.update(measure_throughput(model, inputs.prompts, workload.output_len, factory,
                                          workload.warmup, workload.repeats, progress))
    if settings.ttft:
        metrics.update(measure_latency(model, inputs.prompts[:1],
                                       workload.output_len if settings.decode_batch1 else 1, factory,
                                       workload.warmup, workload.repeats, progress))
    if settings.quality and inputs.eval_blocks is not None:
        metrics.update(evaluate_lm(model, inputs.eval_blocks, settings.eval_batch_size, progress))
