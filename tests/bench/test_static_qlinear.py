"""The static path's linear layers (opus.bench.static_path.qlinear)."""

from __future__ import annotations

import torch

from opus.bench.static_path.qlinear import MinRows, quantize_linear


def test_min_rows_pads_small_batches() -> None:
    linear = torch.nn.Linear(64, 40)
    module, why = quantize_linear(linear, "w8a8")
    assert why is None
    x = torch.randn(3, 64)
    # Padded, the three rows take the int8 GEMM (per-token scales: the zero rows change nothing).
    int8_rows = module(torch.cat([x, x.new_zeros(30, 64)]))[:3]
    torch.testing.assert_close(MinRows(module)(x), int8_rows)
