"""The perplexity through a cache: the whole-sequence perplexity for an exact cache, close for bf16 K/V."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from opus.kv.static import cache_config
from opus.runtime.kv_fidelity import ppl_of_prefill, ppl_through_cache

sys.path.insert(0, str(Path(__file__).parents[1] / "fusion"))
from fusion_kit import prompts, tiny_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@torch.no_grad()
def test_decoding_through_an_exact_cache_gives_the_forward_perplexity():
    model = tiny_lm("llama")
    blocks = prompts(3, 24)
    logits = model(blocks)[:, 11:-1]  # predictions of tokens 12.. (the second half after token 12)
    nll = -torch.log_softmax(logits, -1).gather(-1, blocks[:, 12:, None]).mean()
    want = float(torch.exp(nll))
    assert ppl_through_cache(model, blocks, None) == pytest.approx(want, rel=1e-5)
    assert ppl_through_cache(model, blocks, cache_config(False, slot_multiple=8)) == pytest.approx(want, rel=1e-5)
    narrow = ppl_through_cache(model, blocks, cache_config(False, slot_multiple=8, kv_dtype="bfloat16"))
    assert narrow != want and narrow == pytest.approx(want, rel=2e-2)


@torch.no_grad()
def test_a_prefill_through_a_cache_is_scored_at_every_position():
    from opus.models import native_attention
    from opus.models.attention import BLOCKED_BF16

    model = tiny_lm("llama", head_dim=32)
    blocks = prompts(3, 200)
    logits = model(blocks[:, :-1])
    want = float(torch.exp(-torch.log_softmax(logits, -1).gather(-1, blocks[:, 1:, None]).mean()))
    assert ppl_of_prefill(model, blocks, None) == pytest.approx(want, rel=1e-6)
    exact = ppl_of_prefill(model, blocks, cache_config(False, attention="blocked"))
    assert exact == pytest.approx(want, rel=1e-5)
    lossy = ppl_of_prefill(model, blocks, cache_config(False, attention=BLOCKED_BF16))
    if native_attention.bf16_reason(torch.float32, "cpu", 32) is None:  # the bf16 products ran: close, not equal
        assert lossy != exact and lossy == pytest.approx(want, rel=2e-2)
    else:  # the kernel fell back to fp32 blocks: never less exact than asked
        assert lossy == pytest.approx(exact, rel=1e-6)
