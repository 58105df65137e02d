"""The engine: greedy decode equals full recomputation, cached equals uncached, seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from opus.models import DecoderLM, config_from_hf
from opus.runtime.engine import (
    EngineError,
    Sampling,
    full_logits,
    generate,
    select_next,
    supports_cache,
    timed_generate,
)

VOCAB = 89


def tiny_model(family: str) -> DecoderLM:
    """A random tiny Opus model built from a transformers config (Mixtral MoE or Llama)."""
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = (MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common) if family == "mixtral"
          else LlamaConfig(**common))
    torch.manual_seed(0)
    return DecoderLM(config_from_hf(hf.to_dict())).eval()


@pytest.fixture(scope="module", params=["mixtral", "llama"])
def model(request) -> DecoderLM:
    return tiny_model(request.param)


def prompts(batch: int = 3, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_equals_argmax_of_full_recomputation(model) -> None:
    ids = prompts()
    result = generate(model, ids, 6)
    assert result.tokens.shape == (3, 6) and result.prompt_len == 7
    seq = ids
    for i in range(6):
        expected = full_logits(model, seq)[:, -1].argmax(dim=-1)
        assert torch.equal(result.tokens[:, i], expected), f"token {i}"
        seq = torch.cat((seq, expected[:, None]), dim=1)


def test_cached_decode_logits_equal_uncached(model) -> None:
    ids = prompts(batch=2, length=5, seed=1)
    result = generate(model, ids, 5, return_logits=True)
    full = full_logits(model, torch.cat((ids, result.tokens[:, :-1]), dim=1))
    assert result.logits is not None and result.logits.shape == (2, 5, VOCAB)
    torch.testing.assert_close(result.logits, full[:, 4:], atol=1e-4, rtol=1e-4)


def test_batched_rows_equal_single_requests(model) -> None:
    ids = prompts(batch=3, length=6, seed=2)
    batched = generate(model, ids, 4).tokens
    for row in range(3):
        assert torch.equal(generate(model, ids[row : row + 1], 4).tokens[0], batched[row])


def test_sampling_is_reproducible_with_a_seed(model) -> None:
    ids = prompts(seed=3)
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.95, seed=7)
    first = generate(model, ids, 8, sampling=sampling).tokens
    assert torch.equal(generate(model, ids, 8, sampling=sampling).tokens, first)
    other = generate(model, ids, 8, sampling=Sampling(temperature=1.0, seed=8)).tokens
    assert not torch.equal(other, first)


def test_degenerate_sampling_is_greedy(model) -> None:
    ids = prompts(seed=4)
    greedy = generate(model, ids, 5).tokens
    assert torch.equal(generate(model, ids, 5, sampling=Sampling(temperature=0.0)).tokens, greedy)
    assert torch.equal(generate(model, ids, 5, sampling=Sampling(top_k=1, seed=3)).tokens, greedy)
    assert torch.equal(generate(model, ids, 5, sampling=Sampling(top_p=1e-6, seed=3)).tokens, greedy)


def test_top_k_and_top_p_restrict_the_choices() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(500, 1)
    gen = torch.Generator().manual_seed(0)
    picked = select_next(logits, Sampling(top_k=3), gen)
    assert set(picked.tolist()) == {0, 1, 2}
    probs = logits[0].softmax(-1)  # token 0 holds ~0.64, tokens 0-1 ~0.88
    picked = select_next(logits, Sampling(top_p=0.8), gen)
    assert set(picked.tolist()) == {0, 1}
    assert probs[0] < 0.8 < probs[:2].sum()


def test_timings_and_rates_are_reported(model) -> None:
    result = generate(model, prompts(batch=2), 3)
    assert result.ttft_s > 0 and result.decode_s > 0
    assert result.total_s == pytest.approx(result.ttft_s + result.decode_s)
    assert result.new_tokens == 6 and result.tok_s == pytest.approx(6 / result.total_s)


def test_on_step_sees_every_token(model) -> None:
    seen: list[int] = []
    generate(model, prompts(batch=1), 4, on_step=seen.append)
    assert seen == [0, 1, 2, 3]


def test_timed_generate_gives_the_prefill_and_the_median_step(model) -> None:
    seen: list[int] = []
    result, prefill, step = timed_generate(model, prompts(batch=2), 4, on_step=seen.append)
    assert torch.equal(result.tokens, generate(model, prompts(batch=2), 4).tokens) and seen == [0, 1, 2, 3]
    assert prefill == result.ttft_s and 0 < step <= result.decode_s  # the median of three steps
    assert math.isnan(timed_generate(model, prompts(batch=1), 1)[2])  # one token: no decode step


def test_bad_inputs_and_foreign_models_are_refused(model) -> None:
    with pytest.raises(ValueError, match=r"\[batch, length>0\]"):
        generate(model, torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompts(), 0)
    foreign = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    assert supports_cache(model) and not supports_cache(foreign)
    with pytest.raises(EngineError, match="Sequential"):
        generate(foreign, prompts(), 2)
    assert full_logits(foreign, prompts()).shape == (3, 7, VOCAB)  # the cache-less path still works
