"""Each format's real kernel against a float reference, and the round trip of its packed tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opus.quant.formats import FORMATS, check_format, promote
from opus.quant.kernels import dequant_int4, int4_groupwise

# Relative Frobenius error bounds of y = x W^T against fp32, for a gaussian layer.
BOUNDS = {"w8a16": 0.01, "w8a8": 0.02, "w8a8_tensor": 0.03, "w4a16": 0.12, "bf16": 0.01, "fp16": 0.002}


@pytest.mark.parametrize("fmt", sorted(BOUNDS))
@torch.no_grad()
def test_format_error_within_bound(fmt: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 192)
    x = torch.randn(3, 20, 256)  # 60 rows: W8A8 quantizes these activations (see the decode-size test)
    ref = linear(x)
    module = FORMATS[fmt].build(linear, 128)
    assert type(module) is not nn.Linear
    out = module(x)
    rel = float((out - ref).norm() / ref.norm())
    assert rel < BOUNDS[fmt]
    assert rel > 0 or fmt == "fp32"  # a real low-precision path, not the float layer again
    rebuilt = FORMATS[fmt].empty(linear, 128)
    rebuilt.load_state_dict(module.state_dict())
    assert torch.equal(rebuilt(x), out)


@pytest.mark.parametrize("in_features", [24, 40, 64])
@torch.no_grad()
def test_int8_weights_at_decode_sizes_for_any_width(in_features: int) -> None:
    """W8A16 and W8A8's few-row branch on widths the CPU int8-weight kernel mishandles (not a multiple
    of 16: it returned garbage or crashed) stay within the format's error bound."""
    torch.manual_seed(1)
    linear = nn.Linear(in_features, 32)
    x = torch.randn(5, in_features)  # few rows: W8A8 runs its weight-only branch too
    ref = linear(x)
    for fmt in ("w8a16", "w8a8"):
        out = FORMATS[fmt].build(linear, 8)(x)
        assert float((out - ref).norm() / ref.norm()) < BOUNDS[fmt], fmt


@pytest.mark.parametrize("fmt", sorted(BOUNDS))
@torch.no_grad()
def test_empty_input_gives_empty_output(fmt: str) -> None:
    module = FORMATS[fmt].build(nn.Linear(128, 64), 64)
    assert module(torch.zeros(0, 128)).shape == (0, 64)


def test_packed_storage_is_small() -> None:
    linear = nn.Linear(256, 256, bias=False)
    int8 = FORMATS["w8a8"].build(linear, 128)
    int4 = FORMATS["w4a16"].build(linear, 128)
    bytes_of = lambda m: sum(t.numel() * t.element_size() for t in m.state_dict().values())  # noqa: E731
    assert bytes_of(int8) < 0.27 * bytes_of(linear)
    assert bytes_of(int4) < 0.16 * bytes_of(linear)
    assert {t.dtype for t in int8.state_dict().values()} >= {torch.int8}
    assert int4.state_dict()["qweight"].dtype == torch.uint8


def test_int4_kernel_matches_its_dequantization() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(256, 64, bias=False)
    module = FORMATS["w4a16"].build(linear, 128)
    x = torch.randn(7, 256)
    dense = dequant_int4(module.qweight, module.scales_and_zeros, 128)
    expected = x.bfloat16().float() @ dense.t()  # A16: the kernel takes bf16 activations
    assert float((module(x) - expected).norm() / expected.norm()) < 1e-2
    packed, _ = int4_groupwise(linear.weight, 128)
    assert packed.shape == (64, 128)


@torch.no_grad()
def test_per_token_beats_per_tensor_on_outlier_rows() -> None:
    torch.manual_seed(2)
    linear = nn.Linear(128, 128)
    x = torch.randn(64, 128)
    x[0] *= 200.0  # one loud token ruins a shared activation scale
    ref = linear(x)[1:]
    err = {f: float((FORMATS[f].build(linear, 128)(x)[1:] - ref).norm() / ref.norm())
           for f in ("w8a8", "w8a8_tensor")}
    assert err["w8a8"] * 5 < err["w8a8_tensor"]


@torch.no_grad()
def test_w8a8_runs_decode_sized_inputs_weight_only() -> None:
    """Few rows: the same int8 weights with bf16 activations; many rows: int8 activations too."""
    from opus.quant.formats.w8a8 import Int8DynamicLinear

    torch.manual_seed(3)
    linear = nn.Linear(256, 128, bias=False)
    module = FORMATS["w8a8"].build(linear, 128)
    dense = module.qweight.float() * module.scale.reshape(-1, 1)
    small = torch.randn(Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS, 256)
    weight_only = small.bfloat16().float() @ dense.t()
    assert float((module(small) - weight_only).norm() / weight_only.norm()) < 1e-2
    big = torch.randn(Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS + 8, 256)
    q = torch.clamp(torch.round(big / (big.abs().amax(-1, keepdim=True) / 127)), -127, 127)
    int8_act = (q * big.abs().amax(-1, keepdim=True) / 127) @ dense.t()
    assert float((module(big) - int8_act).norm() / int8_act.norm()) < 1e-5
    assert float((module(big) - big @ dense.t()).norm() / int8_act.norm()) > 1e-4  # activations rounded


def test_fp8_refused_off_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        check_format("fp8", "cpu")


def test_promotion_ladder() -> None:
    assert promote("w4a16", ["w4a16", "w8a8", "w8a16"]) == "w8a8"
    assert promote("w8a8", ["w4a16", "w8a8", "w8a16"]) == "w8a16"
    assert promote("w8a16", ["w8a16"]) == "fp32"
    assert promote("fp32", []) is None
