"""Batched generation over a KV cache: one prefill, then one decode step per new token.

Prompts in a batch must all have the same length (``prompt_ids`` is a plain ``[B, T]`` tensor, no
padding, no attention mask): that is what the measured workloads need, and it keeps every request's
positions identical so the model needs no per-row offsets. Variable-length serving is out of scope.

Timings bracket device work with ``torch.cuda.synchronize`` on CUDA, so they measure the kernels,
not the launch queue. ``ttft_s`` is prefill plus choosing the first token; ``decode_s`` is the
remaining ``max_new_tokens - 1`` steps.
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opus.kv import cache as kvcache
from opus.kv.cache import CacheFactory


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding. ``temperature <= 0`` means greedy; ``top_k = 0`` and ``top_p = 1`` disable."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, max_new_tokens], the new tokens only (on the model's device)
    prompt_len: int
    ttft_s: float
    decode_s: float
    total_s: float
    logits: torch.Tensor | None = None  # [B, max_new_tokens, vocab] when asked for

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def new_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def tok_s(self) -> float:
        """Generated tokens per second over the whole request (prefill included)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("inf")

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second of the decode steps alone (the first token comes from the prefill)."""
        steps = self.tokens.shape[1] - 1
        return self.batch_size * steps / self.decode_s if steps and self.decode_s > 0 else float("nan")


class EngineError(TypeError):
    """The model does not follow the interface the engine drives."""


def model_device(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def supports_cache(model: nn.Module) -> bool:
    """True when ``forward`` takes ``cache``, ``start_pos`` and ``last_only`` (Opus's LM interface)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return all(name in params for name in ("cache", "start_pos", "last_only"))


def eos_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """The end-of-sequence ids the tokenizer and the model's config name (either may be a list)."""
    found: set[int] = set()
    config = getattr(model, "config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        found.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return frozenset(found)


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a model output: a tensor, or an object with ``.logits`` (Hugging Face models)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise EngineError(f"model returned {type(output).__name__}, expected a logits tensor")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def select_next(logits: torch.Tensor, sampling: Sampling | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]."""
    if sampling is None or sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the ones before it already reach top_p; the first token always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int,
             cache_factory: CacheFactory | None = None, sampling: Sampling | None = None,
             return_logits: bool = False, on_step: Callable[[int], None] | None = None,
             done: Callable[[torch.Tensor], bool] | None = None) -> GenerationResult:
    """Generate ``max_new_tokens`` for each row of ``prompt_ids`` ([B, T], equal lengths).

    ``cache_factory`` builds a fresh cache per call (default: the growing cache); ``sampling``
    None is greedy; ``on_step(i)`` is called after each new token (a heartbeat for long runs).
    ``done(tokens)``, given the new tokens so far ([B, i + 1]), ends generation early when it returns
    True (every row reached a stop sequence): ``tokens`` then has fewer than ``max_new_tokens`` columns.
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [batch, length>0], got shape {tuple(prompt_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if not supports_cache(model):
        raise EngineError(f"{type(model).__name__}.forward does not take (input_ids, cache, start_pos, "
                          "last_only); the engine drives Opus's own LM implementations only")
    device = model_device(model)
    prompt_ids = prompt_ids.to(device)
    batch, prompt_len = prompt_ids.shape
    make = cache_factory or kvcache.cache_factory(model)
    generator = None
    if sampling is not None and sampling.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)
    kept: list[torch.Tensor] = []
    with torch.inference_mode():
        cache = make(batch, prompt_len + max_new_tokens)
        sync(device)
        start = time.perf_counter()
        logits = logits_of(model(prompt_ids, cache=cache, start_pos=0, last_only=True))[:, -1]
        tokens[:, 0] = select_next(logits, sampling, generator)
        sync(device)
        first = time.perf_counter()
        if return_logits:
            kept.append(logits.float())
        if on_step:
            on_step(0)
        made = max_new_tokens
        for i in range(1, max_new_tokens):
            if done is not None and done(tokens[:, :i]):
                made = i
                break
            out = model(tokens[:, i - 1 : i], cache=cache, start_pos=prompt_len + i - 1, last_only=True)
            logits = logits_of(out)[:, -1]
            tokens[:, i] = select_next(logits, sampling, generator)
            if return_logits:
                kept.append(logits.float())
            if on_step:
                on_step(i)
        sync(device)
        end = time.perf_counter()
    tokens = tokens[:, :made]
    return GenerationResult(tokens=tokens, prompt_len=prompt_len, ttft_s=first - start, decode_s=end - first,
                            total_s=end - start, logits=torch.stack(kept, dim=1) if return_logits else None)


def timed_generate(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int,
                   cache_factory: CacheFactory | None = None,
                   on_step: Callable[[int], None] | None = None) -> tuple[GenerationResult, float, float]:
    """``generate`` plus a robust timing for choices (opus.runtime.timed_choice): ``(result, prefill_s, step_s)``
    with ``step_s`` the median decode step (NaN for one token), so that a step caught by another
    process is not counted. Each step is waited for on CUDA, so time stamps mean finished work."""
    device = model_device(model)
    stamps: list[float] = []

    def stamp(index: int) -> None:
        sync(device)
        stamps.append(time.perf_counter())
        if on_step:
            on_step(index)

    result = generate(model, prompt_ids, max_new_tokens, cache_factory, on_step=stamp)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return result, result.ttft_s, statistics.median(steps) if steps else float("nan")


def full_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of ``input_ids`` in one cache-less forward pass ([B, T, V])."""
    with torch.inference_mode():
        return logits_of(model(input_ids.to(model_device(model))))
