"""Which request owns which KV blocks: the free list, reference counts and the prefix cache.

A block that holds a full block of a prompt is known by the hash of its parent block's hash and its
own tokens, so two prompts that share a prefix share that prefix's blocks (reference counted): the
second prefill starts after the shared blocks. A block nobody references keeps its contents and its
hash until the space is needed: free blocks are handed out from the never-used ones first, then the
least recently used cached one is evicted.

Admission reserves a request's whole footprint (prompt + max_tokens) up front, so a running request
never waits for a block and nothing is ever preempted; the budget decides how many run at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from opus.serve.kv_blocks import SCRATCH_BLOCK

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's key hash, the block's tokens)


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for the request now (it waits)."""


@dataclass
class Allocation:
    """A request's block table and how many of its first positions came from the prefix cache."""

    blocks: list[int]
    cached_tokens: int
    keys: list[int] = field(default_factory=list)  # hashes of the prompt's full blocks, in order


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"{num_blocks} KV blocks: at least 2 are needed (block {SCRATCH_BLOCK} is scratch)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        # Blocks holding nothing findable, popped from the end (1, 2, ... at first).
        self._blank = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self._refs = [0] * num_blocks
        self._cached: dict[int, int] = {}  # key hash -> block
        self._key_of: dict[int, tuple[int, BlockKey]] = {}  # block -> (key hash, key)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.hits = 0  # prompt tokens served from the prefix cache

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def free(self) -> int:
        return len(self._blank) + len(self._evictable)

    @property
    def used(self) -> int:
        return self.usable - self.free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def prompt_keys(self, prompt: list[int]) -> list[tuple[int, BlockKey]]:
        """The chained keys of the prompt's full blocks, except a block holding its last token: the
        last prompt token is always computed (its logits give the first new token)."""
        keys, parent = [], 0
        for start in range(0, len(prompt) - 1 - self.block_size + 1, self.block_size):
            key: BlockKey = (parent, tuple(prompt[start:start + self.block_size]))
            parent = hash(key)
            keys.append((parent, key))
        return keys

    def allocate(self, prompt: list[int], total_tokens: int) -> Allocation:
        """Blocks for ``total_tokens`` positions, the prompt's cached prefix shared; or OutOfBlocks."""
        keys = self.prompt_keys(prompt) if self.prefix_caching else []
        shared = []
        for digest, key in keys:
            block = self._cached.get(digest)
            if block is None or self._key_of[block][1] != key:
                break
            shared.append(block)
        needed = self.blocks_for(total_tokens) - len(shared)
        reusable = sum(1 for b in shared if self._refs[b] == 0)  # counted in `free` until taken
        if needed > self.free - reusable:
            raise OutOfBlocks(f"{needed} blocks needed, {self.free - reusable} free")
        for block in shared:
            self._take(block)
        fresh = [self._new_block() for _ in range(needed)]
        self.hits += len(shared) * self.block_size
        return Allocation(shared + fresh, len(shared) * self.block_size, [d for d, _ in keys])

    def publish(self, allocation: Allocation, prompt: list[int]) -> None:
        """After the prompt's K/V are written: its full blocks become findable by later prompts."""
        if not self.prefix_caching:
            return
        for index, (digest, key) in enumerate(self.prompt_keys(prompt)):
            block = allocation.blocks[index]
            if digest not in self._cached and block not in self._key_of:
                self._cached[digest] = block
                self._key_of[block] = (digest, key)

    def release(self, allocation: Allocation) -> None:
        for block in allocation.blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None  # most recently used last
                else:
                    self._blank.append(block)
        allocation.blocks = []

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _new_block(self) -> int:
        if self._blank:
            block = self._blank.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            digest, _key = self._key_of.pop(block)
            del self._cached[digest]
        self._refs[block] = 1
        return block
