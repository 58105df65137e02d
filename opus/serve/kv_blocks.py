"""The serving KV cache: fixed-size blocks of slots in one preallocated pool per layer.

Every request owns a list of blocks (its block table); token ``j`` of a request lives in slot
``table[j // block_size] * block_size + j % block_size``. A forward pass gets, per row, the slots
its new tokens are written to and the slots of every position it attends to (``read_slots``, in
position order), so requests of different lengths at different points of their text run in one
batch. Block 0 is never handed out: padding rows (a batch bucket's spare rows) and padding key
positions point at it, and the mask hides it.

CPU attention has no paged kernel here, so attention gathers a row's slots into a dense
``[B, kv_heads, S, head_dim]`` first: one copy of what attention reads anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opus.kv.cache import CacheBase

SCRATCH_BLOCK = 0


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * item


class KVBlockPool:
    """Per layer one K and one V tensor ``[num_blocks * block_size, kv_heads, head_dim]``.

    One whole tensor per layer, not views of one big buffer: a compiled step updates a graph input
    in place, but writing through a view would copy the whole base each step (opus.kv.static).
    """

    def __init__(self, shape: PoolShape) -> None:
        self.shape = shape
        dims = (shape.num_blocks * shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(dims, dtype=shape.dtype, device=shape.device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(dims, dtype=shape.dtype, device=shape.device) for _ in range(shape.num_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def slots_of(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The slots of positions ``start .. end - 1`` of a request whose block table is ``blocks``."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


class PagedView(CacheBase):
    """What the model sees during one serving forward pass (``DecoderLM.forward`` with ``cache=``).

    ``positions`` ``[B, T]``: each new token's position in its own request. ``write_slots`` ``[B * T]``:
    where its K/V go. ``read_slots`` ``[B, S]``: the slots of positions ``0 .. S - 1`` of each row;
    position ``j`` is visible to a token at ``p`` iff ``j <= p`` (``mask`` ``[B, 1, T, S]``).
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], positions: torch.Tensor,
                 write_slots: torch.Tensor, read_slots: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.positions = positions
        self.write_slots, self.read_slots = write_slots, read_slots
        key_pos = torch.arange(read_slots.shape[1], device=read_slots.device)
        self.mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, heads, t, d = k.shape
        self.k[layer].index_copy_(0, self.write_slots, k.transpose(1, 2).reshape(b * t, heads, d))
        self.v[layer].index_copy_(0, self.write_slots, v.transpose(1, 2).reshape(b * t, heads, d))
        keys = self.k[layer][self.read_slots].transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D]
        values = self.v[layer][self.read_slots].transpose(1, 2)
        return keys, values

    @property
    def seq_len(self) -> int:
        return int(self.read_slots.shape[1])

    def reset(self) -> None:
        """Nothing to forget: the view holds no state of its own; requests free their blocks."""
