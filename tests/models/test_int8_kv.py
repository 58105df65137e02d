"""The decode attention over int8 K/V as stored (opus.models.int8_kv): the widened attention's result, from
the int8 bytes, in a compiled graph too, and the widened path where the op does not serve."""

from __future__ import annotations

import pytest
import torch

from opus.models import int8_kv
from opus.models.attention import narrow_kv_attention
from tests.native_kit import built_or_skip


@pytest.fixture(scope="module")
def built() -> None:
    built_or_skip(int8_kv.load, "the int8 K/V attention op")


def stored(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 values and per-slot scales, as opus.kv.stored keeps them."""
    values = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
    return values, torch.rand((*shape[:3], 1), generator=generator) * 0.05 + 0.001


def widened_attention(q, k, v, mask):
    return narrow_kv_attention(q, k[0].float() * k[1], v[0].float() * v[1], mask)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "rows", "slots", "head_dim", "visible"), [
    (3, 8, 2, 1, 128, 32, 100),    # K3's heads; a visible length that is no multiple of 16
    (2, 9, 3, 1, 256, 64, 256),    # the 135M model's: groups of 3, every slot visible
    (1, 4, 4, 2, 64, 128, 37),     # no grouping, two query rows (each its own mask row)
    (2, 8, 2, 1, 64, 32, 7),       # fewer visible slots than one block of 16
])
def test_the_op_gives_the_widened_attention(batch, heads, kv_heads, rows, slots, head_dim, visible) -> None:
    generator = torch.Generator().manual_seed(visible)
    q = torch.randn(batch, heads, rows, head_dim, generator=generator)
    k, v = stored((batch, kv_heads, slots, head_dim), generator), stored((batch, kv_heads, slots, head_dim), generator)
    mask = torch.arange(slots)[None, :] <= torch.arange(visible - rows, visible)[:, None]
    got = int8_kv.attention(q, k[0], k[1], v[0], v[1], mask)
    assert torch.allclose(got, widened_attention(q, k, v, mask), atol=2e-5, rtol=1e-4)
    mask[:, 2] = False  # a slot hidden before the last visible one
    got = int8_kv.attention(q, k[0], k[1], v[0], v[1], mask)
    assert torch.allclose(got, widened_attention(q, k, v, mask), atol=2e-5, rtol=1e-4)


@pytest.mark.usefixtures("built")
def test_a_compiled_graph_calls_the_op_whole() -> None:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 32, generator=generator)
    k, v = stored((2, 2, 64, 32), generator), stored((2, 2, 64, 32), generator)
    mask = torch.arange(64)[None, :] <= torch.tensor([40])[:, None]
    step = torch.compile(lambda q, mask: int8_kv.attention(q * 2, k[0], k[1], v[0], v[1], mask), fullgraph=True)
    assert torch.allclose(step(q, mask), widened_attention(q * 2, k, v, mask), atol=2e-5, rtol=1e-4)


def test_shapes_the_op_does_not_take_are_named() -> None:
    k = torch.zeros(1, 2, 16, 32, dtype=torch.int8)
    assert int8_kv.unsupported(torch.zeros(1, 8, 1, 32), k) is None
    assert "head_dim 48" in int8_kv.unsupported(torch.zeros(1, 8, 1, 48), torch.zeros(1, 2, 16, 48))
    assert "bfloat16" in int8_kv.unsupported(torch.zeros(1, 8, 1, 32, dtype=torch.bfloat16), k)
    assert "17 query heads per KV head" in int8_kv.unsupported(torch.zeros(1, 34, 1, 32), k)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("build", ["avx2", "plain"])
def test_the_narrower_builds_give_the_same_attention(build: str) -> None:
    """The AVX2 and plain x86-64 builds (what a CPU without AVX-512 runs), asked for on this one."""
    widest = int8_kv.build_in_use()
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 1, 64, generator=generator)
    k, v = stored((2, 3, 90, 64), generator), stored((2, 3, 90, 64), generator)
    mask = torch.arange(90)[None, :] <= torch.tensor([70])[:, None]
    try:
        if int8_kv.use_build(build) != build:
            pytest.skip(f"this CPU does not run the {build} build")
        got = int8_kv.attention(q, k[0], k[1], v[0], v[1], mask)
    finally:
        assert int8_kv.use_build(widest) == widest
    assert torch.allclose(got, widened_attention(q, k, v, mask), atol=2e-5, rtol=1e-4)
