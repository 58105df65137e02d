"""The blocked causal attention's C++ op (opus.models.native_attention) gives torch's causal attention within
fp32 rounding, the same bits on one thread and two, eagerly and inside a compiled graph; the decoder's
``blocked`` kernel runs it; where it cannot run it says why and the kernel's torch ops run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opus.models import native_attention
from opus.models.attention import causal_blocks
from opus.models.decoder import attend
from tests.native_kit import built_or_skip, on_threads


@pytest.fixture(autouse=True)
def _built() -> None:
    built_or_skip(native_attention.load, "the C++ attention op")


def qkv(batch: int, heads: int, kv_heads: int, t: int, dim: int) -> tuple[torch.Tensor, ...]:
    """As the decoder makes them: [B, T, heads, D] projections transposed to [B, heads, T, D] (not contiguous)."""
    gen = torch.Generator().manual_seed(batch * 1000 + t)
    return tuple(torch.randn(batch, t, n, dim, generator=gen).transpose(1, 2) for n in (heads, kv_heads, kv_heads))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


# K3's shape; no GQA; a length that ends mid-block; head_dim 64; a prompt shorter than one block
@pytest.mark.parametrize("shape", [(1, 8, 2, 512, 32), (2, 4, 4, 100, 16), (1, 8, 2, 65, 64), (3, 6, 2, 7, 32)])
def test_the_op_gives_torchs_causal_attention(shape: tuple[int, ...]) -> None:
    q, k, v = qkv(*shape)
    out = native_attention.causal(q, k, v)
    torch.testing.assert_close(out, sdpa(q, k, v), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(native_attention.causal(q.contiguous(), k.contiguous(), v.contiguous()), out)
    assert out.transpose(1, 2).is_contiguous()  # the attention block's way back to [B, T, hidden] copies nothing


def test_the_same_bits_on_one_thread_and_two() -> None:
    q, k, v = qkv(2, 8, 2, 300, 32)
    first, second = on_threads(lambda: native_attention.causal(q, k, v))
    assert torch.equal(first, second)


def test_the_decoders_blocked_kernel_runs_the_op_and_torchs_ops_where_it_cannot(monkeypatch) -> None:
    q, k, v = qkv(1, 8, 2, 200, 32)
    with torch.profiler.profile() as prof:
        got = attend(q, k, v, True, True, None, "blocked")
    assert "opus_attention::causal" in {event.key for event in prof.key_averages()}
    assert torch.equal(got, native_attention.causal(q, k, v))
    monkeypatch.setitem(native_attention._STATE, "reason", "OPUS_NATIVE_OPS=0")
    assert native_attention.reason(q, k, v) == "OPUS_NATIVE_OPS=0"
    assert torch.equal(attend(q, k, v, True, True, None, "blocked"), causal_blocks(q, k, v))


def test_a_bf16_prompt_keeps_torchs_ops_and_says_why() -> None:
    q, k, v = (t.bfloat16() for t in qkv(1, 8, 2, 100, 32))
    assert native_attention.reason(q, k, v) == "the C++ attention op runs fp32 on the CPU, not torch.bfloat16 on cpu"
    torch.testing.assert_close(attend(q, k, v, True, True, None, "blocked"), causal_blocks(q, k, v))


def test_inside_a_compiled_graph_the_op_gives_what_it_gives_eagerly() -> None:
    q, k, v = qkv(1, 8, 2, 130, 32)
    compiled = torch.compile(lambda q, k, v: attend(q, k, v, True, True, None, "blocked").transpose(1, 2).reshape(
        1, 130, 256) * 2, fullgraph=True)
    want = native_attention.causal(q, k, v).transpose(1, 2).reshape(1, 130, 256) * 2
    assert torch.equal(compiled(q, k, v), want)
