"""Quantize / dequantize tensors. Pure functions; the GEMMs themselves live in ``modules.py``."""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: weight ≈ q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row (token) of a 2-D activation; returns q and a [M, 1] scale."""
    # Few dispatched ops on purpose: at decode sizes this quantization costs more than the GEMM.
    # x / (absmax / 127) never leaves [-127, 127], so no clamp is needed. (abs().amax() measured
    # 15x faster here than linalg.vector_norm(ord=inf) on CPU.)
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-8).div_(INT8_MAX)
    q = torch.round(x / scale).to(torch.int8)
    return q, scale


def int8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 with one scale for the whole activation (the naive baseline)."""
    scale = x.abs().amax().float().clamp(min=1e-8) / INT8_MAX
    q = torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.reshape(1, 1).expand(x.shape[0], 1)


def int4_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of input channels.

    Returns nibbles packed two per byte ``[out, in // 2]`` (a portable layout; kernels repack it) and
    ``scales_and_zeros [in // group, out, 2]`` such that ``w ≈ (q - 8) * scale + zero``, the
    convention of torch's int4 weight-only GEMM.
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((w_max - w_min) / 15.0).clamp(min=1e-8)
    q = torch.round((w - w_min[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(out_features, in_features)
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    zero = w_min + 8.0 * scale
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[out, in // 2]`` uint8 -> ``[out, in]`` int32 nibbles 0..15."""
    high, low = (packed >> 4).to(torch.int32), (packed & 0xF).to(torch.int32)
    return torch.stack([high, low], dim=-1).reshape(packed.shape[0], -1)


def dequant_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    q = unpack_int4(packed).float()
    out_features, in_features = q.shape
    sz = scales_and_zeros.transpose(0, 1)  # [out, groups, 2]
    q = q.reshape(out_features, in_features // group_size, group_size)
    return ((q - 8.0) * sz[..., 0:1] + sz[..., 1:2]).reshape(out_features, in_features)


def fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


# -- fake quantization: sensitivity analysis only, never the measured model -----------------------

def fake_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    q, scale = int8_per_channel(weight)
    return (q.float() * scale[:, None]).to(weight.dtype)


def fake_int4_weight(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    packed, sz = int4_groupwise(weight, group_size)
    return dequant_int4(packed, sz, group_size).to(weight.dtype)


def fake_int8_activation(x: torch.Tensor, per_token: bool = True) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    q, scale = int8_per_token(flat) if per_token else int8_per_tensor(flat)
    return (q.float() * scale).to(x.dtype).reshape(x.shape)
