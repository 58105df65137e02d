"""A model as one ONNX graph for onnxruntime: next-token logits from ``input_ids`` (no cache), the int8
kernels' ONNX translations, and an onnxruntime session as the exports' checks and the bench open it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


class LogitsOnly(nn.Module):
    """``model(input_ids) -> float32 logits`` with no cache: the one signature the ONNX graph gets."""

    def __init__(self, model: nn.Module, last_only: bool) -> None:
        super().__init__()
        self.model, self.last_only = model, last_only

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids, last_only=True) if self.last_only else self.model(input_ids)
        return logits.float()


def accepts_last_only(model: nn.Module) -> bool:
    return "last_only" in inspect.signature(model.forward).parameters


def onnx_translations() -> dict[Any, Callable[..., Any]]:
    """ONNX for the int8 kernels Opus's quantized linears call, which the exporter has no translation for.

    ``_int_mm`` (W8A8) is ONNX's own MatMulInteger (on uint8 operands, below); ``_weight_int8pack_mm``
    (W8A16) dequantizes the int8 weight in the graph. The int4 (tinygemm-packed) and FP8 kernels have
    none: those modules still fail to export, and the stage reports which op.
    """
    import numpy as np
    import onnx_ir as ir
    from onnxscript import opset18 as op

    def as_uint8(x: Any) -> Any:
        """int8 -> uint8 with zero point 128: the same integers, read as (x_u8 - 128)."""
        shift = op.Constant(value=ir.tensor(np.array(128, np.int16)))
        return op.Cast(op.Add(op.Cast(x, to=ir.DataType.INT16), shift), to=ir.DataType.UINT8)

    def int_mm(a: Any, b: Any) -> Any:
        # onnxruntime's int8 x int8 MatMulInteger takes a slow path on x86 (K3's experts: ~6x slower than
        # uint8 x int8 on an AVX-512 VNNI CPU), and uint8 x int8 can saturate on CPUs without VNNI
        # (VPMADDUBSW's 16-bit sums). uint8 x uint8 with zero points 128 is the same integer product, exact
        # on every CPU, ~3x faster than int8 x int8 here. onnxruntime folds the weight's shift at load.
        zero = op.Constant(value=ir.tensor(np.array(128, np.uint8)))
        return op.MatMulInteger(as_uint8(a), as_uint8(b), zero, zero)

    def weight_int8pack_mm(x: Any, weight: Any, scales: Any) -> Any:
        # The kernel takes bf16 activations; onnxruntime's CPU MatMul has no bf16, so compute in fp32.
        x32 = op.Cast(x, to=1)  # 1 = FLOAT
        w32 = op.Transpose(op.Cast(weight, to=1), perm=[1, 0])
        return op.CastLike(op.Mul(op.MatMul(x32, w32), op.Cast(scales, to=1)), x)

    return {torch.ops.aten._int_mm.default: int_mm, torch.ops.aten._weight_int8pack_mm.default: weight_int8pack_mm}


def export_onnx(wrapper: nn.Module, path: Path, example: torch.Tensor) -> None:
    dims = {"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}}
    torch.onnx.export(wrapper, (example,), str(path), dynamo=True, input_names=["input_ids"],
                      output_names=["logits"], dynamic_shapes=dims, external_data=True, verbose=False,
                      custom_translation_table=onnx_translations())


def ort_session(path: Path, device: str, threads: int | None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    # Idle worker threads would otherwise spin after each run, taking the CPU from whatever runs next
    # (opus bench interleaves its contenders round by round).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), options, providers=providers)

