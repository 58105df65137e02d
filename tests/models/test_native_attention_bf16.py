"""The blocked causal attention's bf16 variant (``opus_attention::causal_bf16``, kernel ``blocked_bf16``) gives
torch's causal attention over the bf16-rounded Q, K and V within the rounding of its softmax weights, the same
bits on one thread and two, eagerly and compiled; where it cannot run it says why and the fp32 op runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opus.models import native_attention
from opus.models.attention import BLOCKED_BF16
from opus.models.decoder import attend
from tests.native_kit import built_or_skip, on_threads


@pytest.fixture(autouse=True)
def _built() -> None:
    built_or_skip(native_attention.load, "the C++ attention op")
    if not native_attention.cpu_has_bf16():  # a fact of the machine, said as such
        pytest.skip("this CPU has no AVX-512 BF16, which the bf16 attention op needs")


def qkv(batch: int, heads: int, kv_heads: int, t: int, dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(batch * 1000 + t)
    return tuple(torch.randn(batch, t, n, dim, generator=gen).transpose(1, 2) for n in (heads, kv_heads, kv_heads))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


# K3's shape; no GQA, head_dim 64, a length ending mid-block; head_dim 96 (three 32-dim chunks); a prompt
# shorter than one block; one key past a block (an odd key count)
@pytest.mark.parametrize("shape", [(1, 8, 2, 512, 32), (2, 4, 4, 200, 64), (3, 6, 2, 130, 96), (1, 8, 2, 7, 32),
                                   (1, 2, 1, 65, 32)])
def test_the_bf16_op_gives_attention_over_bf16_inputs(shape: tuple[int, ...]) -> None:
    q, k, v = qkv(*shape)
    out = native_attention.causal(q, k, v, bf16=True)
    rounded = sdpa(*(t.bfloat16().float() for t in (q, k, v)))
    # What is left beyond the inputs' rounding is the weights' (bf16: 2^-9 relative) in a weighted mean of
    # values of about unit size.
    assert float((out - rounded).abs().max()) < 6e-3
    assert float((out - sdpa(q, k, v)).abs().max()) < 3e-2  # and from fp32 attention: bf16's, not more
    assert float((out - sdpa(q, k, v)).abs().max()) > 1e-5  # it did round: not the fp32 op by another name
    assert torch.equal(native_attention.causal(q.contiguous(), k.contiguous(), v.contiguous(), bf16=True), out)


def test_a_nan_key_makes_the_rows_that_see_it_nan_as_torchs_attention_does() -> None:
    q, k, v = (t.contiguous() for t in qkv(1, 8, 2, 200, 32))
    k[0, 1, 150, 3] = float("nan")
    out, want = native_attention.causal(q, k, v, bf16=True), sdpa(q, k, v)
    assert torch.equal(out.isnan(), want.isnan()) and out[0, 4:, 150:].isnan().all()
    assert not out[0, :4].isnan().any() and not out[0, 4:, :150].isnan().any()


def test_the_same_bits_on_one_thread_and_two() -> None:
    q, k, v = qkv(2, 8, 2, 300, 64)
    first, second = on_threads(lambda: native_attention.causal(q, k, v, bf16=True))
    assert torch.equal(first, second)


def test_the_decoders_kernel_runs_it_and_the_fp32_op_where_it_cannot(monkeypatch) -> None:
    q, k, v = qkv(1, 8, 2, 200, 32)
    with torch.profiler.profile() as prof:
        got = attend(q, k, v, True, True, None, BLOCKED_BF16)
    assert "opus_attention::causal_bf16" in {event.key for event in prof.key_averages()}
    assert torch.equal(got, native_attention.causal(q, k, v, bf16=True))
    monkeypatch.setitem(native_attention._STATE, "bf16", False)  # a CPU without AVX-512 BF16
    assert native_attention.bf16_reason(torch.float32, "cpu", 32) == (
        "this CPU has no AVX-512 BF16 (the bf16 attention op's dot products)")
    assert torch.equal(attend(q, k, v, True, True, None, BLOCKED_BF16), native_attention.causal(q, k, v))


def test_a_head_size_or_dtype_it_does_not_take_is_named() -> None:
    assert native_attention.bf16_reason(torch.float32, "cpu", 16) == (
        "the bf16 attention op takes a head size that is a multiple of 32, not 16")
    assert "not torch.bfloat16 on cpu" in native_attention.bf16_reason(torch.bfloat16, "cpu", 32)
    q, k, v = qkv(1, 4, 2, 100, 16)  # the decoder's kernel then runs the fp32 op
    assert torch.equal(attend(q, k, v, True, True, None, BLOCKED_BF16), native_attention.causal(q, k, v))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.opus_attention.causal_bf16(q, k, v, native_attention.BLOCK)


def test_inside_a_compiled_graph_it_gives_what_it_gives_eagerly() -> None:
    q, k, v = qkv(1, 8, 2, 130, 32)
    compiled = torch.compile(lambda q, k, v: attend(q, k, v, True, True, None, BLOCKED_BF16).transpose(1, 2).reshape(
        1, 130, 256) * 2, fullgraph=True)
    want = native_attention.causal(q, k, v, bf16=True).transpose(1, 2).reshape(1, 130, 256) * 2
    assert torch.equal(compiled(q, k, v), want)
