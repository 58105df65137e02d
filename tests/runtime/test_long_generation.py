"""Long generation scored by the unmodified model: a decode path that loses its way after 128 tokens shows as
late segments whose NLL jumps, though the model's weights — and so its perplexity — are untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opus.kv.cache import GrowingKVCache, cache_factory
from opus.models import load_model
from opus.runtime.long_generation import continuation_nll, score_long_generation

K3 = Path(__file__).resolve().parents[2] / "examples" / "k3"
LIMIT = 128


class ForgetfulCache(GrowingKVCache):
    """A broken cache: past ``LIMIT`` positions it hands attention only the first ones and the newest."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_all, v_all = super().update(layer, k, v)
        if k_all.shape[2] <= LIMIT:
            return k_all, v_all
        return (torch.cat([k_all[:, :, : LIMIT - 1], k_all[:, :, -1:]], 2),
                torch.cat([v_all[:, :, : LIMIT - 1], v_all[:, :, -1:]], 2))


def _prompts(tokenizer) -> torch.Tensor:
    files = sorted((K3 / "data" / "heldout").glob("*.txt"))[:4]
    return torch.tensor([tokenizer.encode(f.read_text())[:64] for f in files])


def test_a_cache_that_forgets_after_128_positions_fails_late_where_perplexity_cannot_see() -> None:
    model, tokenizer = load_model({"hf": str(K3 / "model")})
    prompts = _prompts(tokenizer)
    growing = cache_factory(model)
    same, _ = score_long_generation(model, growing, model, growing, prompts, 256, 64)
    assert same["long_nll_increase_max"] == 0.0 and same["long_nll"] == same["long_nll_base"]

    metrics, info = score_long_generation(model, lambda b, n: ForgetfulCache(model.config.num_layers), model,
                                          growing, prompts, 256, 64)
    rise = [s["nll"] - s["nll_base"] for s in info["segments"]]
    assert [s["tokens"] for s in info["segments"]] == [[0, 64], [64, 128], [128, 192], [192, 256]]
    assert rise[0] == 0.0  # prompt (64) + 63 tokens < 128 positions: the same text, token for token
    # From position 128 on it forgets: every later segment costs the unmodified model more (measured on K3:
    # +0.57, +0.22, +0.88 nats per token), the whole text +0.42.
    assert min(rise[1:]) > 0.1 and max(rise[1:]) > 0.4
    assert metrics["long_nll_increase_max"] == pytest.approx(max(rise), abs=1e-3)
    assert metrics["long_nll"] > metrics["long_nll_base"] + 0.2
    # As a gate holds it: perplexity (teacher-forced, cache-less, the same weights) passes, long generation fails.
    from opus.pipeline.gates import check_gate
    from opus.pipeline.spec import Threshold
    from opus.runtime.metrics import evaluate_lm

    ppl = evaluate_lm(model, prompts)["perplexity"]
    verdict = check_gate({"perplexity": Threshold(max_increase=0.01), "long_nll_increase_max": Threshold(max=0.3)},
                         {**metrics, "perplexity": ppl}, {"perplexity": ppl})
    failed = [c.metric for c in verdict.checks if not c.passed]
    assert failed == ["long_nll_increase_max"]


def test_continuation_nll_is_the_cross_entropy_of_each_new_token() -> None:
    model, tokenizer = load_model({"hf": str(K3 / "model")})
    prompts = _prompts(tokenizer)[:, :16]
    new = prompts[:, :5].flip(1)
    nll = continuation_nll(model, prompts, new)
    with torch.no_grad():
        logits = model(torch.cat([prompts, new], 1))[:, 15:-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), new.reshape(-1),
                                                 reduction="none").reshape(new.shape)
    assert nll.shape == (4, 5) and torch.allclose(nll, expected, atol=1e-5)
