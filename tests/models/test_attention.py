"""Opus's blocked causal attention gives torch's SDPA results, and steps aside where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opus.models.attention import CAUSAL_BLOCK, blocked_attention, causal_blocks, check_kernel
from opus.models.decoder import attend


def qkv(batch: int, heads: int, kv_heads: int, t: int, s: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(t * 31 + s)
    q = torch.randn(batch, heads, t, 16, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, s, 16, generator=gen).to(dtype)
    return q, k, torch.randn(batch, kv_heads, s, 16, generator=gen).to(dtype)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("t", [CAUSAL_BLOCK + 1, 3 * CAUSAL_BLOCK, 200])
def test_causal_blocks_give_sdpa_causal_attention(heads, kv_heads, t):
    q, k, v = qkv(2, heads, kv_heads, t, t)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(causal_blocks(q, k, v), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend(q, k, v, True, heads != kv_heads, None, "blocked"), want, atol=1e-5, rtol=1e-5)


def test_cases_the_kernel_does_not_cover_fall_back_to_sdpa():
    short = qkv(1, 4, 2, CAUSAL_BLOCK, CAUSAL_BLOCK)  # one block: nothing to skip
    assert blocked_attention(*short, True, None) is None
    q, k, v = qkv(3, 8, 2, 1, 40)  # a decode step over masked slots
    mask = torch.arange(40)[None, :] <= 17
    assert blocked_attention(q, k, v, False, mask) is None
    torch.testing.assert_close(attend(q, k, v, False, True, mask, "blocked"), attend(q, k, v, False, True, mask))


def test_an_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="attention must be one of sdpa, blocked, blocked_bf16, got 'flash'"):
        check_kernel("flash")


def test_attention_over_narrower_kv_gives_sdpa_over_the_same_values():
    from opus.models.attention import narrow_kv_attention

    q, k, v = qkv(3, 8, 2, 1, 40)
    mask = torch.arange(40)[None, :] <= 17
    kb, vb = k.bfloat16(), v.bfloat16()
    want = attend(q, kb.float(), vb.float(), False, True, mask)  # the same stored values, in fp32 throughout
    got = narrow_kv_attention(q, kb, vb, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # q and the probabilities rounded to bf16
    torch.testing.assert_close(attend(q, kb, vb, False, True, mask), got)  # attend takes this path itself
