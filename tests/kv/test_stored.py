"""How a static cache stores K/V: int8 with a scale per token and head, read back within half a step."""

from __future__ import annotations

import pytest
import torch

from opus.kv.stored import kv_dtype_of, quantized, scale_buffers, store, widened


def test_int8_values_come_back_within_half_a_step_of_their_scale():
    x = torch.randn(2, 3, 5, 16) * torch.tensor([1e-3, 1.0, 50.0]).view(1, 3, 1, 1)  # heads of any range
    values, scale = quantized(x)
    assert values.dtype == torch.int8 and scale.shape == (2, 3, 5, 1)
    assert values.abs().amax(-1).eq(127).all()  # each (token, head)'s largest value uses the full range
    assert (widened(values, scale) - x).abs().le(scale / 2 * (1 + 1e-5)).all()


def test_a_zero_token_stores_zeros_not_nan():
    values, scale = quantized(torch.zeros(1, 1, 2, 8))
    assert torch.equal(widened(values, scale), torch.zeros(1, 1, 2, 8))


def test_store_writes_only_the_given_slots():
    buffer = torch.zeros(1, 2, 6, 4, dtype=torch.int8)
    [scales, _] = scale_buffers(tuple(buffer.shape), 1, torch.int8, torch.float32, torch.device("cpu"))
    x = torch.randn(1, 2, 2, 4)
    store(buffer, scales, torch.tensor([3, 4]), x)
    read = widened(buffer, scales)
    assert torch.equal(read[:, :, [0, 1, 2, 5]], torch.zeros(1, 2, 4, 4))
    assert torch.allclose(read[:, :, 3:5], x, atol=float(x.abs().max()) / 127)
    floats = torch.zeros(1, 2, 6, 4, dtype=torch.bfloat16)
    store(floats, None, torch.tensor([0]), x[:, :, :1])
    assert torch.equal(widened(floats, None)[:, :, 0], x[:, :, 0].bfloat16())


def test_dtypes_by_name():
    assert kv_dtype_of(None, torch.float32) is torch.float32
    assert kv_dtype_of("int8", torch.float32) is torch.int8
    assert scale_buffers((1, 1, 4, 8), 3, torch.bfloat16, torch.float32, torch.device("cpu")) == []
    with pytest.raises(ValueError, match="kv_dtype must be one of bfloat16, float16, int8"):
        kv_dtype_of("fp8", torch.float32)
