"""How much a lossy KV cache (K/V kept narrower than the model, opus.kv.static ``kv_dtype``) costs.

The measure is the perplexity of text decoded through the cache: each block's first half is the
prompt (its attention sees its own keys as computed), then every later token is fed one decode step at
a time, teacher-forced, so each prediction reads the cache's stored K/V as a real decode does. The same
blocks through the growing cache (the model's own dtype) give the reference. A whole-sequence forward
(the eval stage's perplexity) never reads a cache, so it cannot see this loss.
"""

from __future__ import annotations

from typing import Any

import torch

FIDELITY_BLOCKS = 8
FIDELITY_LEN = 128


def text_or_random(evaluation: Any, tokenizer: Any, base_dir: Any, vocab: int, length: int,
                   seed: int) -> tuple[torch.Tensor, str]:
    """``FIDELITY_BLOCKS`` blocks of ``length`` tokens of the evaluation text, else random ids; and which."""
    from opus.runtime.data import DataError, load_blocks, random_blocks

    if evaluation is not None and tokenizer is not None:
        try:
            blocks = load_blocks(evaluation, tokenizer, base_dir)
            if blocks.shape[1] >= length:
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
