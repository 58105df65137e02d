"""A preallocated, growing-in-steps KV cache whose storage comes from (and returns to) a pool.

Cache kind ``"pooled"`` (``POOLED``, registered with ``opus.kv.cache``; a kv_config stage writes it into the recipe)::

    {"kind": "pooled", "provider": "opus.kv.pool", "prealloc": 512, "step": 1024, "max_context": 8192}

Each sequence starts with room for ``prealloc`` tokens (or more, rounded up by ``step``, if the
first prefill needs it); a layer that runs out grows by whole ``step``s up to ``max_context``.
``update`` writes in place and returns views, so a decode step copies one token per layer instead of
the whole cache (``torch.cat`` in the growing cache). Storage of a finished request — released
explicitly, on ``reset``, or when the cache is garbage-collected — goes to a pool that the next
request takes it from instead of asking the allocator again.

Sizing: ``kv_bytes_per_token`` (2 × layers × KV heads × head dim × bytes per element) and a memory
budget give ``max_batch``, the largest batch whose caches fit.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from opus.kv.cache import CacheBase, CacheShape, KindBase, KVCache, register_kind
from opus.kv.sizing import kv_bytes_per_token, memory_budget

__all__ = ["POOLED", "BlockPool", "PooledKVCache", "cache_config", "capacity_for", "default_pool",
           "kv_bytes_per_token", "max_batch", "memory_budget", "options_of"]

KIND = "pooled"
DEFAULTS = {"prealloc": 512, "step": 1024, "max_context": 8192}


# -- sizing -------------------------------------------------------------------------------------------
def capacity_for(tokens: int, prealloc: int, step: int, max_context: int) -> int:
    """Positions allocated for ``tokens``: ``prealloc``, then whole ``step``s, never past ``max_context``."""
    if tokens > max_context:
        raise ValueError(f"{tokens} positions exceed the KV cache's max_context {max_context}")
    cap = prealloc if tokens <= prealloc else prealloc + math.ceil((tokens - prealloc) / step) * step
    return min(cap, max_context)


def max_batch(budget_bytes: int, per_token_bytes: int, context_len: int, prealloc: int, step: int,
              max_context: int) -> int:
    """The largest number of sequences whose caches (as allocated, steps included) fit the budget."""
    per_sequence = per_token_bytes * capacity_for(context_len, prealloc, step, max_context)
    return max(0, budget_bytes // per_sequence)


# -- the pool ------------------------------------------------------------------------------------------
@dataclass
class PoolStats:
    allocated: int = 0  # blocks obtained from the allocator
    reused: int = 0  # blocks handed out again from the pool
    released: int = 0
    pooled_bytes: int = 0  # held in the pool right now


class BlockPool:
    """Freed flat storage blocks, keyed by (dtype, device), handed out best-fit.

    A request takes the smallest free block that is big enough and at most ``max_slack`` times its
    size: a small cache handed a large request's block would hold (and report) memory it never uses,
    so the request gets fresh storage instead. ``max_bytes`` caps what the pool holds (the largest
    blocks beyond it go back to the allocator).
    """

    def __init__(self, max_bytes: int | None = None, max_slack: float = 2.0) -> None:
        if max_slack < 1:
            raise ValueError(f"max_slack must be at least 1, not {max_slack}")
        self.max_bytes, self.max_slack = max_bytes, max_slack
        self._free: dict[tuple[torch.dtype, str], list[torch.Tensor]] = defaultdict(list)
        self.stats = PoolStats()

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(dtype, str(device))]
        fits = [i for i, b in enumerate(free) if numel <= b.numel() <= numel * self.max_slack]
        if fits:
            block = free.pop(min(fits, key=lambda i: free[i].numel()))  # by index: tensors have no ==
            self.stats.reused += 1
            self.stats.pooled_bytes -= block.numel() * block.element_size()
            return block
        self.stats.allocated += 1
        # A normal tensor, even under inference_mode: the pool is process-wide, and a block made as an
        # inference tensor could not be written by a cache used outside inference_mode later.
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, device=device)

    def release(self, block: torch.Tensor) -> None:
        self.stats.released += 1
        size = block.numel() * block.element_size()
        if self.max_bytes is not None and self.stats.pooled_bytes + size > self.max_bytes:
            return  # over the cap: let the allocator have it
        self._free[(block.dtype, str(block.device))].append(block)
        self.stats.pooled_bytes += size

    def clear(self) -> None:
        self._free.clear()
        self.stats.pooled_bytes = 0


_DEFAULT_POOL = BlockPool()


def default_pool() -> BlockPool:
    """The process's pool: every pooled cache built from a recipe draws from it."""
    return _DEFAULT_POOL


def _release_all(pool: BlockPool, blocks: dict[int, torch.Tensor]) -> None:
    for block in blocks.values():
        pool.release(block)
    blocks.clear()


# -- the cache ----------------------------------------------------------------------------------------
class PooledKVCache(CacheBase):
    """KV cache for one batch: per layer one block ``[2, B, H, capacity, D]`` (K and V) from the pool."""

    def __init__(self, num_layers: int | None = None, prealloc: int = 512, step: int = 1024,
                 max_context: int = 8192, pool: BlockPool | None = None) -> None:
        if prealloc < 1 or step < 1 or max_context < 1:
            raise ValueError("prealloc, step and max_context must be positive")
        self.num_layers, self.prealloc, self.step, self.max_context = num_layers, prealloc, step, max_context
        self.pool = pool or default_pool()
        self._blocks: dict[int, torch.Tensor] = {}  # layer -> flat storage
        self._kv: dict[int, torch.Tensor] = {}  # layer -> [2, B, H, cap, D] view of the block
        self._len: dict[int, int] = {}
        self.grows = 0
        # Storage goes back to the pool when the engine drops the cache, without a reference to self.
        self._finalizer = weakref.finalize(self, _release_all, self.pool, self._blocks)

    def _allocate(self, layer: int, like: torch.Tensor, cap: int) -> torch.Tensor:
        b, h, _, d = like.shape
        block = self.pool.acquire(2 * b * h * cap * d, like.dtype, like.device)
        self._blocks[layer] = block
        return block[: 2 * b * h * cap * d].view(2, b, h, cap, d)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._len.get(layer, 0)
        end = start + k.shape[2]
        kv = self._kv.get(layer)
        if kv is None or end > kv.shape[3]:
            cap = capacity_for(end, self.prealloc, self.step, self.max_context)
            old, old_block = kv, self._blocks.get(layer)
            kv = self._allocate(layer, k, cap)
            if old is not None:
                kv[:, :, :, :start].copy_(old[:, :, :, :start])
                self.pool.release(old_block)
                self.grows += 1
            self._kv[layer] = kv
        kv[0, :, :, start:end].copy_(k)
        kv[1, :, :, start:end].copy_(v)
        self._len[layer] = end
        return kv[0, :, :, :end], kv[1, :, :, :end]

    @property
    def seq_len(self) -> int:
        if not self._len or (self.num_layers is not None and len(self._len) < self.num_layers):
            return 0
        return min(self._len.values())

    def capacity(self, layer: int = 0) -> int:
        kv = self._kv.get(layer)
        return int(kv.shape[3]) if kv is not None else 0

    def release(self) -> None:
        """Hand all storage back to the pool; the cache is empty (and reusable) afterwards."""
        self._kv.clear()
        self._len.clear()
        _release_all(self.pool, self._blocks)

    def reset(self) -> None:
        self.release()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._blocks.values())


def options_of(config: dict[str, Any]) -> dict[str, int]:
    """Validated pooled-cache options (defaults filled in); unknown keys are an error."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"pooled KV cache: unknown option(s) {', '.join(unknown)} (known: {', '.join(DEFAULTS)})")
    return {k: int(config.get(k, v)) for k, v in DEFAULTS.items()}


def cache_config(prealloc: int = 512, step: int = 1024, max_context: int = 8192) -> dict[str, Any]:
    """The cache config a recipe step carries (``opus.kv.cache.kv_cache_step(cache_config(...))``)."""
    return POOLED.config(prealloc=prealloc, step=step, max_context=max_context)


class _PooledKind(KindBase):
    name, provider, simplicity = KIND, "opus.kv.pool", 1

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache:
        opts = options_of(options)
        if shape.max_seq_len > opts["max_context"]:
            raise ValueError(f"a request of {shape.max_seq_len} positions exceeds the pooled KV cache's "
                             f"max_context {opts['max_context']}")
        return PooledKVCache(shape.num_layers, pool=default_pool(), **opts)

    def max_batch(self, budget_bytes: int, per_token_bytes: int, context_len: int, options: dict[str, Any]) -> int:
        return max_batch(budget_bytes, per_token_bytes, context_len, **options_of(options))

    def candidates(self, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """One per ``prealloc`` × ``step`` the stage lists, capped at its ``max_context``."""
        context = int(settings.get("max_context", DEFAULTS["max_context"]))
        return [cache_config(p, s, context) for p in settings.get("prealloc", [DEFAULTS["prealloc"]])
                for s in settings.get("step", [DEFAULTS["step"]])]


POOLED = register_kind(_PooledKind())
