"""What a KV cache costs, whatever its kind: bytes per token, and the memory a stage may give caches."""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def memory_budget(fraction: float = 0.5, device: torch.device | str = "cpu") -> int:
    """``fraction`` of the memory available now (CUDA: free device memory; else psutil's available)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    import psutil

    return int(psutil.virtual_memory().available * fraction)
