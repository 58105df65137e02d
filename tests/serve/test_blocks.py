"""Block bookkeeping: reference counts, the prefix cache's chained keys, least-recently-used eviction."""

from __future__ import annotations

import pytest

from opus.serve.blocks import BlockManager, OutOfBlocks


def test_shared_prefix_blocks_are_reference_counted_and_survive_until_evicted() -> None:
    manager = BlockManager(num_blocks=7, block_size=2)  # 6 usable
    prompt = [1, 2, 3, 4, 5]
    first = manager.allocate(prompt, 6)  # 3 blocks, nothing cached yet
    assert first.cached_tokens == 0 and len(first.blocks) == 3 and manager.free == 3
    manager.publish(first, prompt)  # blocks holding [1, 2] and [3, 4] become findable
    second = manager.allocate([1, 2, 3, 4, 9], 6)
    assert second.cached_tokens == 4 and second.blocks[:2] == first.blocks[:2]
    assert manager.free == 2  # one fresh block taken; the two shared ones are referenced twice
    manager.release(first)
    assert manager.free == 3  # the shared blocks are still held by the second request
    manager.release(second)
    assert manager.free == 6 and manager.used == 0
    third = manager.allocate([1, 2, 3, 4, 7], 5)  # unreferenced but cached: found again
    assert third.cached_tokens == 4
    manager.release(third)


def test_a_different_first_block_shares_nothing_even_when_later_tokens_match() -> None:
    manager = BlockManager(num_blocks=9, block_size=2)
    a = manager.allocate([1, 2, 3, 4, 5], 5)
    manager.publish(a, [1, 2, 3, 4, 5])
    b = manager.allocate([9, 9, 3, 4, 5], 5)  # [3, 4] matches, but its parent differs
    assert b.cached_tokens == 0


def test_the_last_prompt_token_is_never_served_from_the_cache() -> None:
    manager = BlockManager(num_blocks=9, block_size=2)
    a = manager.allocate([1, 2, 3, 4], 4)
    manager.publish(a, [1, 2, 3, 4])
    again = manager.allocate([1, 2, 3, 4], 4)
    assert again.cached_tokens == 2  # [3, 4] holds the last token, whose logits give the first new one


def test_eviction_takes_the_least_recently_used_cached_block_and_forgets_its_key() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)  # 3 usable
    old = manager.allocate([1, 2, 0], 3)
    manager.publish(old, [1, 2, 0])
    manager.release(old)  # [1, 2]'s block is cached and unreferenced
    newer = manager.allocate([5, 6, 0], 3)
    manager.publish(newer, [5, 6, 0])
    manager.release(newer)
    assert manager.free == 3
    big = manager.allocate([7], 6)  # all three blocks: both cached ones evicted, oldest first
    assert manager.free == 0
    with pytest.raises(OutOfBlocks):
        manager.allocate([8], 1)
    manager.release(big)
    assert manager.allocate([1, 2, 0], 3).cached_tokens == 0  # evicted: computed again


def test_without_prefix_caching_nothing_is_shared() -> None:
    manager = BlockManager(num_blocks=9, block_size=2, prefix_caching=False)
    a = manager.allocate([1, 2, 3], 3)
    manager.publish(a, [1, 2, 3])
    assert manager.allocate([1, 2, 3], 3).cached_tokens == 0
