"""How much a lossy KV cache costs: K/V kept narrower than the model (opus.kv.static ``kv_dtype``), or a
lossy prefill attention kernel (opus.models.attention ``LOSSY_KERNELS``).

The measure is the perplexity of text decoded through the cache: each block's first half is the
prompt (its attention sees its own keys as computed), then every later token is fed one decode step at
a time, teacher-forced, so each prediction reads the cache's stored K/V as a real decode does. The same
blocks through the growing cache (the model's own dtype) give the reference. A whole-sequence forward
(the eval stage's perplexity) never reads a cache, so it cannot see this loss.

A prefill kernel's loss is the perplexity of every next token of longer blocks (``PREFILL_FIDELITY_LEN``,
at least two of the kernel's query blocks) predicted by one prefill through a cache running that kernel,
against the same prefill through the model's own attention (no cache).
"""

from __future__ import annotations

from typing import Any

import torch

FIDELITY_BLOCKS = 8
FIDELITY_LEN = 128
PREFILL_FIDELITY_LEN = 512  # or the evaluation text's block length, down to PREFILL_SHORTEST
PREFILL_SHORTEST = 129  # a blocked prefill's kernel runs from two query blocks of 64 on


def text_or_random(evaluation: Any, tokenizer: Any, base_dir: Any, vocab: int, length: int,
                   seed: int, shortest: int | None = None) -> tuple[torch.Tensor, str]:
    """``FIDELITY_BLOCKS`` blocks of ``length`` tokens of the evaluation text (or as long as its blocks are,
    from ``shortest`` on), else random ids; and which."""
    from opus.runtime.data import DataError, load_blocks, random_blocks

    if evaluation is not None and tokenizer is not None:
        try:
            blocks = load_blocks(evaluation, tokenizer, base_dir)
            if blocks.shape[1] >= (shortest or length):
                return blocks[:FIDELITY_BLOCKS, :length].clone(), "evaluation text"
        except DataError:
            pass  # the random ids below, named as such in the figures
    return random_blocks(FIDELITY_BLOCKS, length, vocab, seed), "random token ids"


@torch.inference_mode()
def ppl_through_cache(model: torch.nn.Module, blocks: torch.Tensor, cache: dict[str, Any] | None) -> float:
    """Perplexity of ``blocks[:, T/2 + 1:]`` predicted one decode step at a time through ``cache``
    (a cache config; None: the growing cache)."""
    from opus.kv.cache import cache_factory
    from opus.runtime.engine import model_device

    blocks = blocks.to(model_device(model))
    rows, length = blocks.shape
    prompt = length // 2
    made = cache_factory(model, cache)(rows, length)
    logits = [model(blocks[:, :prompt], cache=made, start_pos=0, last_only=True)[:, -1]]
    for pos in range(prompt, length - 1):
        logits.append(model(blocks[:, pos : pos + 1], cache=made, start_pos=pos, last_only=True)[:, -1])
    logprobs = torch.log_softmax(torch.stack(logits, dim=1).float(), dim=-1)
    nll = -logprobs.gather(-1, blocks[:, prompt:, None]).mean()
    return float(torch.exp(nll))


def prefill_length(model: torch.nn.Module) -> int:
    """``PREFILL_FIDELITY_LEN``, or fewer where the model's positions end sooner."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(PREFILL_FIDELITY_LEN, positions) if isinstance(positions, int) else PREFILL_FIDELITY_LEN


@torch.inference_mode()
def ppl_of_prefill(model: torch.nn.Module, blocks: torch.Tensor, cache: dict[str, Any] | None) -> float:
    """Perplexity of every next token of ``blocks`` predicted by one prefill from position 0 through ``cache``
    (a cache config, whose attention kernel the prefill runs; None: the model's own attention, no cache)."""
    from opus.kv.cache import cache_factory
    from opus.runtime.engine import model_device

    blocks = blocks.to(model_device(model))
    made = None if cache is None else cache_factory(model, cache)(*blocks.shape)
    logits = model(blocks[:, :-1], cache=made, start_pos=0, last_only=False)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float(torch.exp(-logprobs.gather(-1, blocks[:, 1:, None]).mean()))


def measure_lossy_part(model: torch.nn.Module, part: tuple[str, str], slot_multiple: int, evaluation: Any,
                       tokenizer: Any, base_dir: Any,
                       seed: int) -> tuple[dict[str, Any], dict[str, Any], tuple[int, ...]]:
    """One lossy part of a cache, ``("kv_dtype", dtype)`` or ``("attention", kernel)``, against the exact one,
    through the cache's eager steps (no graph compiled for the measurement): K/V in that dtype over text decoded
    through the cache (``ppl_through_cache``); a lossy attention kernel over one prefill of longer blocks
    (``ppl_of_prefill``). Returns (the figures, the cache config measured, the blocks' shape)."""
    from opus.kv.static import cache_config
    from opus.runtime.metrics import vocab_size

    key, value = part
    if key == "kv_dtype":
        length, shortest, measure = FIDELITY_LEN, None, ppl_through_cache
        config = cache_config(False, slot_multiple, kv_dtype=value)
    else:
        length, measure = prefill_length(model), ppl_of_prefill
        shortest = min(length, PREFILL_SHORTEST)
        config = cache_config(False, slot_multiple, attention=value)
    blocks, source = text_or_random(evaluation, tokenizer, base_dir, vocab_size(model), length, seed, shortest)
    reference, ppl = measure(model, blocks, None), measure(model, blocks, config)
    return ({"ppl": ppl, "reference_ppl": reference, "increase": ppl / reference - 1, "text": source},
            config, tuple(blocks.shape))
