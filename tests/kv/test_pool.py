"""The pooled KV cache: preallocation, growth in steps, storage reuse, sizing, same tokens as the plain cache."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from opus.kv.cache import cache_factory, make_cache
from opus.kv.choice import cache_config_from_recipe, kv_cache_step
from opus.kv.pool import (
    BlockPool,
    PooledKVCache,
    cache_config,
    capacity_for,
    default_pool,
    kv_bytes_per_token,
    max_batch,
)
from opus.recipe import apply_step
from opus.runtime.engine import generate

sys.path.insert(0, str(Path(__file__).parents[1] / "fusion"))
from fusion_kit import prompts, tiny_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def kv(tokens: int, batch: int = 2, heads: int = 2, dim: int = 4, fill: float = 1.0) -> torch.Tensor:
    return torch.full((batch, heads, tokens, dim), fill)


def test_capacity_grows_in_steps_up_to_max_context():
    assert [capacity_for(n, 512, 1024, 8192) for n in (1, 512, 513, 1536, 1537)] == [512, 512, 1536, 1536, 2560]
    assert capacity_for(8000, 512, 1024, 8192) == 8192  # the last step is cut at max_context
    with pytest.raises(ValueError, match="max_context"):
        capacity_for(8193, 512, 1024, 8192)


def test_cache_grows_in_steps_and_keeps_its_contents():
    cache = PooledKVCache(num_layers=1, prealloc=8, step=4, max_context=20, pool=BlockPool())
    k_all, _ = cache.update(0, kv(5, fill=1.0), kv(5, fill=-1.0))
    assert cache.capacity() == 8 and k_all.shape[2] == 5 and cache.grows == 0
    cache.update(0, kv(3, fill=2.0), kv(3))
    assert cache.capacity() == 8 and cache.grows == 0  # 8 positions: still the preallocation
    k_all, v_all = cache.update(0, kv(1, fill=3.0), kv(1))
    assert cache.capacity() == 12 and cache.grows == 1 and cache.seq_len == 9  # one step of 4
    assert torch.equal(k_all[:, :, :5], kv(5, fill=1.0)) and torch.equal(v_all[:, :, :5], kv(5, fill=-1.0))
    assert torch.equal(k_all[:, :, 5:8], kv(3, fill=2.0)) and torch.equal(k_all[:, :, 8:], kv(1, fill=3.0))
    cache.update(0, kv(8), kv(8))
    assert cache.capacity() == 20  # 17 positions: two more steps would be 20 = max_context
    with pytest.raises(ValueError, match="max_context"):
        cache.update(0, kv(4), kv(4))


def test_freed_blocks_are_reused_not_reallocated():
    pool = BlockPool()
    first = PooledKVCache(num_layers=2, prealloc=8, step=4, pool=pool)
    for layer in range(2):
        first.update(layer, kv(6), kv(6))
    storages = {first._blocks[layer].data_ptr() for layer in range(2)}
    first.release()
    assert pool.stats.allocated == 2 and pool.stats.pooled_bytes > 0
    second = PooledKVCache(num_layers=2, prealloc=8, step=4, pool=pool)
    for layer in range(2):
        second.update(layer, kv(3, fill=7.0), kv(3))
    assert {second._blocks[layer].data_ptr() for layer in range(2)} == storages  # the same storage
    assert pool.stats.allocated == 2 and pool.stats.reused == 2
    k_all, _ = second.update(0, kv(1, fill=9.0), kv(1))
    assert torch.equal(k_all[:, :, :3], kv(3, fill=7.0))  # no stale data from the first request is visible

    del second  # dropped without release (what the engine does): its storage still returns to the pool
    gc.collect()
    assert pool.stats.reused == 2 and len(pool._free[(torch.float32, "cpu")]) == 2


def test_a_grown_cache_returns_its_small_block_to_the_pool():
    pool = BlockPool()
    cache = PooledKVCache(num_layers=1, prealloc=4, step=4, pool=pool)
    cache.update(0, kv(4), kv(4))
    small = cache._blocks[0].data_ptr()
    cache.update(0, kv(1), kv(1))
    assert [b.data_ptr() for b in pool._free[(torch.float32, "cpu")]] == [small]


def test_sizing_gives_the_largest_batch_that_fits():
    per_token = kv_bytes_per_token(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert per_token == 2 * 4 * 2 * 16 * 2
    per_sequence = per_token * capacity_for(640, 512, 1024, 8192)  # 640 positions -> 1536 allocated
    assert max_batch(10 * per_sequence + 1, per_token, 640, 512, 1024, 8192) == 10


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_same_tokens_as_the_growing_cache(family):
    model = tiny_lm(family)
    ids = prompts(2, 6)
    plain = generate(model, ids, 12, cache_factory(model))
    pooled_cfg = cache_config(prealloc=4, step=3, max_context=64)  # grows during the prefill and the decode
    for _ in range(2):  # the second request runs on reused storage
        pooled = generate(model, ids, 12, cache_factory(model, pooled_cfg), return_logits=False)
        assert torch.equal(pooled.tokens, plain.tokens)
    assert default_pool().stats.reused > 0


def test_registry_and_recipe_step():
    model = tiny_lm("llama")
    step = kv_cache_step(cache_config(prealloc=16, step=8, max_context=128))
    assert apply_step(model, step) is model  # the kv_cache step changes no module
    config = cache_config_from_recipe([{"kind": "fuse", "sites": []}, step])
    cache = make_cache(config, model.config, batch_size=2, max_seq_len=40)
    assert isinstance(cache, PooledKVCache) and (cache.prealloc, cache.step, cache.max_context) == (16, 8, 128)
    with pytest.raises(ValueError, match="unknown option"):
        make_cache({**config, "blocks": 3}, model.config, 1, 8)
    with pytest.raises(ValueError, match="exceeds"):
        make_cache(config, model.config, 1, 129)


def test_a_block_made_under_inference_mode_can_be_written_outside_it():
    """The pool is process-wide: a block first made inside ``inference_mode`` comes back to a cache
    used outside it (a CI run failed on that, depending on test order)."""
    pool = BlockPool()
    with torch.inference_mode():
        block = pool.acquire(16, torch.float32, torch.device("cpu"))
        block.fill_(1.0)
    pool.release(block)
    again = pool.acquire(16, torch.float32, torch.device("cpu"))
    assert again is block and pool.stats.reused == 1
    again.copy_(torch.arange(16.0))  # an inference tensor would refuse this in-place write
    assert again.tolist() == list(range(16))


def test_a_block_far_larger_than_the_request_is_not_handed_out():
    """A small cache given a big request's freed block would hold and report memory it never uses
    (kv_config's memory check and max_batch read ``nbytes``): beyond ``max_slack`` it gets fresh storage."""
    pool, cpu = BlockPool(max_slack=2.0), torch.device("cpu")
    big = pool.acquire(1000, torch.float32, cpu)
    pool.release(big)
    small = pool.acquire(100, torch.float32, cpu)
    assert small is not big and small.numel() == 100 and pool.stats.reused == 0
    near = pool.acquire(600, torch.float32, cpu)  # within twice the request: reused
    assert near is big and pool.stats.reused == 1
    cache = PooledKVCache(num_layers=1, prealloc=4, step=4, pool=pool)
    pool.release(pool.acquire(64 * 2 * 2 * 64, torch.float32, cpu))  # a large request's block, freed
    cache.update(0, kv(3), kv(3))
    assert cache.nbytes() == 2 * 2 * 2 * 4 * 4 * 4  # K and V × batch 2 × 2 heads × 4 positions × dim 4, fp32
    with pytest.raises(ValueError, match="max_slack"):
        BlockPool(max_slack=0.5)
