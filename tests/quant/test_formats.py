"""The format registry: each registered format's module, fake quantization, constraints and metadata."""

from __future__ import annotations

import pkgutil

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

import opus.quant.formats as formats_pkg
from opus.pipeline.code_reach import reach, stage_reach
from opus.quant.formats import FORMATS, LADDER, Format, check_format, is_quantized, ladder, noop_name, register
from stages.plan import Config as PlanConfig

# Relative Frobenius error of each format's real kernel against fp32 y = x W^T + b, gaussian layer.
KERNEL_BOUNDS = {"fp32": 0.0, "bf16": 0.01, "fp16": 0.002, "w8a16": 0.01, "w4a16": 0.12, "w8a8": 0.02,
                 "w8a8_tensor": 0.03, "fp8": 0.08}
# Fake quantization (what the planner scores) against the real kernel: A16 kernels round activations
# to bf16, which fake quantization leaves alone; fp8's fake weight is a plain cast, the kernel's rowwise.
FAKE_BOUNDS = {"fp32": 0.0, "bf16": 0.01, "fp16": 0.002, "w8a16": 0.01, "w4a16": 0.01, "w8a8": 1e-5,
               "w8a8_tensor": 1e-5, "fp8": 0.2}
# Tensor names, shapes and dtypes a 256→192 layer with bias stores: checkpoints hold exactly these.
LAYOUTS = {
    "fp32": {"weight": ((192, 256), torch.float32), "bias": ((192,), torch.float32)},
    "bf16": {"weight": ((192, 256), torch.bfloat16), "bias": ((192,), torch.bfloat16)},
    "fp16": {"weight": ((192, 256), torch.float16), "bias": ((192,), torch.float16)},
    "w8a16": {"bias": ((192,), torch.float32), "qweight": ((192, 256), torch.int8), "scale": ((192,), torch.float32)},
    "w8a8": {"bias": ((192,), torch.float32), "qweight": ((192, 256), torch.int8), "scale": ((1, 192), torch.float32)},
    "w8a8_tensor": {"bias": ((192,), torch.float32), "qweight": ((192, 256), torch.int8),
                    "scale": ((1, 192), torch.float32)},
    "w4a16": {"bias": ((192,), torch.float32), "qweight": ((192, 128), torch.uint8),
              "scales_and_zeros": ((2, 192, 2), torch.float32)},
    "fp8": {"bias": ((192,), torch.float32), "qweight": ((192, 256), torch.float8_e4m3fn),
            "scale": ((1, 192), torch.float32)},
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _runnable(name: str) -> str:
    try:
        check_format(name, DEVICE)
    except ValueError as exc:
        pytest.skip(str(exc))
    return name


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_every_registered_format_is_covered_here() -> None:
    assert set(FORMATS) == set(KERNEL_BOUNDS) == set(FAKE_BOUNDS) == set(LAYOUTS)


@pytest.mark.parametrize("name", sorted(KERNEL_BOUNDS))
@torch.no_grad()
def test_module_round_trips_a_linear_within_its_tolerance(name: str) -> None:
    fmt = FORMATS[_runnable(name)]
    torch.manual_seed(0)
    linear = nn.Linear(256, 192, device=DEVICE)
    x = torch.randn(3, 20, 256, device=DEVICE)  # 60 rows: W8A8 quantizes these activations
    ref = linear(x)
    module = fmt.build(linear, 128)
    out = module(x)
    assert _rel(out, ref) <= KERNEL_BOUNDS[name]
    assert is_quantized(module) != fmt.is_noop
    layout = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    assert layout == LAYOUTS[name]
    rebuilt = fmt.empty(nn.Linear(256, 192, device=DEVICE), 128)
    rebuilt.load_state_dict(module.state_dict())
    assert torch.equal(rebuilt(x), out)


@pytest.mark.parametrize("name", sorted(FAKE_BOUNDS))
@torch.no_grad()
def test_fake_quant_matches_the_real_kernel(name: str) -> None:
    fmt = FORMATS[_runnable(name)]
    torch.manual_seed(1)
    linear = nn.Linear(256, 128, device=DEVICE)
    x = torch.randn(64, 256, device=DEVICE)
    fake = F.linear(fmt.fake_quant_input(x), fmt.fake_quant_weight(linear.weight, 128), linear.bias)
    real = fmt.build(linear, 128)(x)
    assert _rel(fake, real) <= FAKE_BOUNDS[name]
    # and fake quantization changes something wherever the format rounds the weights
    assert fmt.is_noop or not torch.equal(fmt.fake_quant_weight(linear.weight, 128), linear.weight)


def test_constraints_reject_bad_shapes_with_the_reason() -> None:
    odd = nn.Linear(100, 64)
    narrow = nn.Linear(128, 40)
    assert "in_features % 128 == 0" in FORMATS["w4a16"].unsupported(odd, 128)
    assert "out_features % 16 == 0" in FORMATS["w4a16"].unsupported(narrow, 128)
    assert FORMATS["w4a16"].unsupported(narrow, 64) is not None and FORMATS["w4a16"].unsupported(odd, 4) is None
    for name in ("w8a8", "w8a8_tensor", "fp8"):
        assert "divisible by 8" in FORMATS[name].unsupported(odd, 128)
        assert "(layer is 100→64)" in FORMATS[name].unsupported(odd, 128)
        assert FORMATS[name].unsupported(narrow, 128) is None
    for name in ("fp32", "bf16", "fp16", "w8a16"):
        assert FORMATS[name].unsupported(odd, 128) is None
    with pytest.raises(ValueError, match="multiple of group_size"):
        FORMATS["w4a16"].build(odd, 128)


def test_plan_config_rejects_an_unknown_format_naming_the_known_ones() -> None:
    with pytest.raises(ValidationError) as info:
        PlanConfig(formats=["w8a8", "int3"])
    message = str(info.value)
    assert "unknown format 'int3'" in message
    for name in FORMATS:
        assert (name in message) != FORMATS[name].is_noop
    with pytest.raises(ValidationError, match="unknown format 'fp32'"):  # always considered, never listed
        PlanConfig(formats=["fp32"])
    assert PlanConfig(formats=["w8a8_tensor", "bf16"]).formats == ["w8a8_tensor", "bf16"]


def test_ladder_and_flags_come_from_the_registry() -> None:
    assert LADDER == ladder() == ("w4a16", "w8a8_tensor", "w8a8", "fp8", "w8a16", "bf16", "fp16", "fp32")
    assert noop_name() == "fp32" and FORMATS["fp32"].module is None
    assert {n for n, f in FORMATS.items() if f.acts_quantized} == {"w8a8", "w8a8_tensor", "fp8"}
    assert {n for n, f in FORMATS.items() if f.smoothquant} == {"w8a8", "fp8"}  # per-tensor is the naive one
    assert {n for n, f in FORMATS.items() if f.uses_group_size} == {"w4a16"}
    assert {n for n, f in FORMATS.items() if f.cuda_only} == {"fp8"}
    assert {n for n, f in FORMATS.items() if f.static_path} == {"w8a8", "w4a16", "fp8"}
    assert FORMATS["w4a16"].recipe_options(64) == {"group_size": 64} and FORMATS["w8a8"].recipe_options(64) == {}


def test_export_mappings_are_data() -> None:
    gguf = {n: f.export.gguf for n, f in FORMATS.items()}
    assert gguf == {"fp32": "F32", "bf16": "BF16", "fp16": "F16", "w8a16": "Q8_0", "w8a8": "Q8_0",
                    "w8a8_tensor": "Q8_0", "w4a16": "Q4_K", "fp8": None}
    schemes = {n: f.export.compressed_tensors for n, f in FORMATS.items()}
    assert all(schemes[n] is None for n in ("fp32", "bf16", "fp16"))
    assert schemes["w8a8"]["weights"]["strategy"] == "channel"
    assert schemes["w8a8"]["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True,
                                                    "strategy": "token", "dynamic": True}
    assert schemes["w8a8_tensor"]["input_activations"]["strategy"] == "tensor"
    assert schemes["w8a16"]["input_activations"] is None and schemes["w8a16"]["weights"]["num_bits"] == 8
    assert schemes["w4a16"]["weights"] == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                          "group_size": "from the recipe"}
    assert schemes["fp8"]["weights"]["type"] == "float" and schemes["fp8"]["preset"] == "FP8_DYNAMIC"


def test_registry_refuses_clashes() -> None:
    with pytest.raises(ValueError, match="ladder rank 30"):
        register(Format("w8a8_again", 8, rank=30, module=nn.Linear))
    with pytest.raises(ValueError, match="keeps the float layer"):
        register(Format("fp64", 64, rank=1000))
    assert "w8a8_again" not in FORMATS and "fp64" not in FORMATS


def test_every_format_module_is_imported_statically() -> None:
    """Stage cache keys hash the code reached by import: a format module found only by listing the
    directory would change results without changing any stage's key."""
    modules = {m.name for m in pkgutil.iter_modules(formats_pkg.__path__, "opus.quant.formats.")}
    assert modules <= set(reach(("opus.quant.formats",), ("opus",)))
    assert modules <= set(stage_reach("stages.plan")) & set(stage_reach("stages.quantize"))
