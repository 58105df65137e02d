"""How a static KV cache keeps K and V: in the model's dtype, in a narrower float, or in int8.

``kv_dtype`` (opus.kv.static): absent keeps the model's dtype; ``bfloat16`` / ``float16`` round each
value; ``int8`` keeps each (token, KV head)'s ``head_dim`` values as int8 with one scale (absolute
maximum / 127, symmetric, in the model's dtype), a quarter of fp32's bytes plus 4 per 32 values at K3's
head_dim. Per token and head, because a token's keys are written once and never requantized, and
because outlier channels in one token do not widen another's steps. All three are read through
``widened``: a float buffer as it is, int8 multiplied back by its scales (a decode step then runs
opus.models.attention.narrow_kv_attention over the widened values). Lossy dtypes race in kv_config only
after their perplexity through the cache is
measured (opus.runtime.kv_fidelity).
"""

from __future__ import annotations

import torch

KV_DTYPES = ("bfloat16", "float16", "int8")
INT8_MAX = 127.0


def kv_dtype_of(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache keeps K and V in: ``name`` (one of ``KV_DTYPES``), or the model's when None."""
    if name is None:
        return model_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or absent: the model's), got {name!r}")
    return getattr(torch, name)


def scale_buffers(dims: tuple[int, ...], layers: int, dtype: torch.dtype, model_dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor]:
    """One ``[B, KV, S, 1]`` scale buffer per layer for int8 K (then V): ``2 × layers``; none otherwise."""
    if dtype != torch.int8:
        return []
    return [torch.ones((*dims[:3], 1), dtype=model_dtype, device=device) for _ in range(2 * layers)]


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, KV, T, D]`` as int8 and its per-(token, head) scales ``[B, KV, T, 1]``."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / INT8_MAX
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def store(buffer: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x [B, KV, T, D]`` into ``buffer``'s ``slots`` (dim 2): in its dtype, int8 with ``scales``."""
    if scales is None:
        buffer.index_copy_(2, slots, x.to(buffer.dtype))
        return
    values, scale = quantized(x)
    buffer.index_copy_(2, slots, values)
    scales.index_copy_(2, slots, scale.to(scales.dtype))


def widened(buffer: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """A buffer as attention reads it: floats as kept, int8 times its scales (the scales' dtype)."""
    return buffer if scales is None else buffer.to(scales.dtype) * scales
