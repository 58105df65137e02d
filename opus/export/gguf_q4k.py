"""GGUF Q4_K blocks from a float matrix: the one GGUF type Opus writes that gguf-py cannot quantize.

gguf-py (0.19, and llama.cpp's master) dequantizes Q4_K but has no ``quantize_blocks`` for it, so
``gguf.quants.quantize`` raises for Q4_K. This module writes the block layout that gguf-py's
``Q4_K.dequantize_blocks`` (and llama.cpp's ``block_q4_K``) reads; tests/export/test_gguf_mix.py
checks every field against that dequantizer.

A block is 256 weights of one row: ``d`` and ``dmin`` (fp16), 12 bytes holding 8 six-bit scales and
8 six-bit minimums (one per sub-block of 32), then 128 bytes of 4-bit values; a weight is
``d * scale * q - dmin * min``. Each sub-block's step and minimum are chosen as llama.cpp's
reference quantizer chooses them: candidate steps (range/14..16), each followed by a weighted
least-squares fit of step and minimum to the 4-bit codes it gives (minimum clamped at 0), the one with
the least weighted error kept. Opus adds the candidates range/1..13: Opus's W4A16 weights lie on a
16-level grid per group, of which a sub-block of 32 often uses fewer levels; with them the fit finds
the grid itself, and only the 6-bit rounding of steps and minimums remains.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per block
SUB = 32  # weights per sub-block
# Steps tried: the range divided into 14..16 levels (llama.cpp's candidates), and into 1..13 whole
# levels, which finds the grid of a sub-block that uses only part of its group's 16 levels.
CANDIDATES = np.concatenate([np.arange(1.0, 14.0), np.arange(14.0, 16.01, 0.1)])
CHUNK = 1024  # blocks fitted at once (memory: candidates x chunk x 256 floats per array)


def _fit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (last axis) the step and minimum (both >= 0; weight = step * q - minimum)."""
    w = np.abs(x) + np.sqrt(np.mean(x * x, axis=-1, keepdims=True))  # error weights, as llama.cpp's Q4_K
    low = np.minimum(x.min(axis=-1, keepdims=True), 0.0)
    span = x.max(axis=-1, keepdims=True) - low
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(span > 0, CANDIDATES.reshape(-1, 1, 1, 1) / span, 0.0)  # [K, blocks, 8, 1]
    q = np.clip(np.rint(inv * (x - low)), 0, 15)
    sw, sq, sqq = w.sum(-1), (w * q).sum(-1), (w * q * q).sum(-1)
    sx, sqx = (w * x).sum(-1), (w * q * x).sum(-1)
    det = sw * sqq - sq * sq
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(det > 0, (sw * sqx - sx * sq) / det, 0.0)
        base = np.where(det > 0, (sqq * sx - sq * sqx) / det, 0.0)
        positive = base > 0  # a minimum above 0 cannot be stored: fit the step alone
        step = np.where(positive, np.where(sqq > 0, sqx / sqq, 0.0), step)
    base = np.where(positive, 0.0, base)
    err = (w * (step[..., None] * q + base[..., None] - x) ** 2).sum(-1)
    best = err.argmin(axis=0)[None]
    step = np.take_along_axis(step, best, 0)[0]
    base = np.take_along_axis(base, best, 0)[0]
    return np.maximum(step, 0.0), -base


def _six_bit(values: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 step, 6-bit codes) with ``step * code ~ values`` for each block's 8 values."""
    step = (top / 63).astype(np.float16)
    step32 = step.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step32 > 0, np.rint(values / step32), 0)
    return step, np.clip(codes, 0, 63).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 scales and 8 minimums (6 bits each) into 12 bytes: the inverse of gguf-py's ``get_scale_min``."""
    lo_sc, hi_sc, lo_mn, hi_mn = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    first = lo_sc | ((hi_sc >> 4) << 6)
    second = lo_mn | ((hi_mn >> 4) << 6)
    third = (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """``[..., n]`` float (n % 256 == 0) -> ``[..., n // 256 * 144]`` uint8 Q4_K blocks."""
    if weight.shape[-1] % QK_K:
        raise ValueError(f"Q4_K needs rows of a multiple of {QK_K} values, not {weight.shape[-1]}")
    x = np.asarray(weight, dtype=np.float32).reshape(-1, QK_K // SUB, SUB)
    fits = [_fit(x[i:i + CHUNK]) for i in range(0, len(x), CHUNK)]
    scale, minimum = np.concatenate([f[0] for f in fits]), np.concatenate([f[1] for f in fits])
    d, sc = _six_bit(scale, scale.max(axis=-1, keepdims=True))
    dmin, mn = _six_bit(minimum, minimum.max(axis=-1, keepdims=True))
    step = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * mn)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((x + offset) / step), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, SUB)  # pairs of sub-blocks share bytes
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, QK_K // 2)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             _pack_scales(sc, mn), qs], axis=1)
    return blocks.reshape(*weight.shape[:-1], weight.shape[-1] // QK_K * blocks.shape[1])
