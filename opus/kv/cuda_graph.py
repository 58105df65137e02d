"""A static KV cache: one preallocated buffer per K and V, written in place at a position tensor.

Shapes never change, so a decode step that writes position ``p`` and attends to every slot with a
``key_pos <= p`` mask has the same shapes at every step and can be captured in a CUDA graph. Slots
past the current position hold stale values; the mask hides them, and each is overwritten before
any query can see it.
"""

from __future__ import annotations

import torch

from opus.models.config import ModelConfig


class StaticKVCache:
    """K and V for every layer: ``[layers, batch, kv_heads, max_seq_len, head_dim]`` each."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # Key positions 0..S-1: a decode mask is ``key_pos <= query position``.
        self.key_pos = torch.arange(max_seq_len, device=device)

    @classmethod
    def for_config(cls, cfg: ModelConfig, batch_size: int, max_seq_len: int, device: torch.device | str,
                   dtype: torch.dtype) -> StaticKVCache:
        return cls(cfg.num_layers, batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim, device, dtype)

    @property
    def batch_size(self) -> int:
        return int(self.k.shape[1])

    @property
    def max_seq_len(self) -> int:
        return int(self.k.shape[3])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store ``k, v`` ([B, H, T, D]) of ``layer`` at ``positions`` ([T] long, on the cache's device)."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot of ``layer`` ([B, H, S, D] views); mask the ones past the query's position."""
        return self.k[layer], self.v[layer]

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, S]`` boolean: query at ``positions[t]`` may see key slot ``s`` iff ``s <= positions[t]``."""
        return self.key_pos[None, :] <= positions[:, None]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
