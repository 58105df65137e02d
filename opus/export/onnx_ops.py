"""ONNX pieces the KV-cache export adds: int4 weights for onnxruntime, bf16 graphs run in float32, the optimizer.

``int4_translations``: W4A16 layers call torch's CPU int4 GEMM (``aten._weight_int4pack_mm_for_cpu``, or
``opus::int4_mm_cpu`` under compile and export), whose weight is in the kernel's packed layout:
rows in blocks of B (four times the CPU's float vector width: 64 with AVX-512, 32 with AVX2; found by
packing a probe, ``kernel_block_rows``), for each input channel k B / 2 bytes, byte n = row n (low
nibble) | row n + B / 2 (high nibble); the rows past the last full block pairwise, byte j = row 2j |
row 2j + 1. The graph unpacks the nibbles and repacks them as onnxruntime's ``com.microsoft.MatMulNBits``
reads them (pairs along k, low nibble first; onnxruntime folds this at load, so the session keeps
4-bit weights). The kernel computes ``x @ ((q - 8) * scale + zero)`` per group of input channels,
with bf16 activations, scales and zeros and a bf16 result; the graph computes ``MatMulNBits(x)``
(zero point 8) plus ``sum(x over each group) @ zero``, in float32 between the same bf16 roundings
(tests/export: full blocks and tails, against the kernel through a quantized model).

``compute_in_float32``: onnxruntime's CPU provider has almost no bfloat16 kernels, so a graph exported
from a bf16 model is rewritten: every bf16 value becomes float32 (inputs, outputs, Cast targets,
constants), bf16 initializers stay bf16 in the external data file and are cast once at load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FLOAT, BF16 = 1, 16  # onnx.TensorProto data types


def _unpack_rows(packed: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel's ``[n, k / 2]`` bytes -> ``[n, k]`` nibbles, if its blocks are ``block`` rows (as the graph does)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    low, high, main = packed & 15, packed >> 4, n // block * block
    parts = []
    if main:
        pair = torch.cat([low[:main].reshape(main // block, k, block // 2),
                          high[:main].reshape(main // block, k, block // 2)], 2)
        parts.append(pair.transpose(1, 2).reshape(main, k))
    if n > main:
        tail = torch.cat([low[main:].reshape(k, (n - main) // 2, 1), high[main:].reshape(k, (n - main) // 2, 1)], 2)
        parts.append(tail.reshape(k, n - main).T)
    return torch.cat(parts, 0)


@functools.cache
def kernel_block_rows() -> int:
    """Rows per block of torch's CPU int4 packing on this machine (aten/src/ATen/native/cpu/int4mm_kernel.cpp:
    four float vectors), found by packing a probe: the layout differs between AVX-512 and AVX2 builds."""
    nibbles = torch.randint(0, 16, (192, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    for block in (64, 32, 16):
        if torch.equal(_unpack_rows(packed, block).to(torch.int32), nibbles):
            return block
    raise RuntimeError("torch's CPU int4 packing has a layout the ONNX export does not know")


def int4_translations() -> dict[Any, Callable[..., Any]]:
    import numpy as np
    import onnx_ir as ir
    from onnxscript import opset18 as op
    from onnxscript.values import Op, Opset

    matmul_nbits = Op(Opset("com.microsoft", 1), "MatMulNBits", _matmul_nbits_schema())

    def unpack(weight: Any) -> Any:
        """The kernel's packed ``[n, k / 2]`` bytes -> ``[n, k]`` nibbles."""
        n, half_k = (int(d) for d in weight.shape)
        block_n = kernel_block_rows()
        k, main, tail = 2 * half_k, n // block_n * block_n, n % block_n
        low = op.BitwiseAnd(weight, op.Constant(value=ir.tensor(np.array(15, np.uint8))))
        high = op.BitShift(weight, op.Constant(value=ir.tensor(np.array(4, np.uint8))), direction="RIGHT")
        low_tail, high_tail = low, high
        if main and tail:  # the full blocks' rows, then the tail's (Gather: Split needs a form ORT rejects)
            rows, rest = op.Constant(value_ints=list(range(main))), op.Constant(value_ints=list(range(main, n)))
            low, low_tail = op.Gather(low, rows, axis=0), op.Gather(low, rest, axis=0)
            high, high_tail = op.Gather(high, rows, axis=0), op.Gather(high, rest, axis=0)
        parts = []
        if main:  # per block and input channel: block_n / 2 bytes, row r (low nibble), row r + block_n / 2 (high)
            shape = op.Constant(value_ints=[main // block_n, k, block_n // 2])
            block = op.Concat(op.Reshape(low, shape), op.Reshape(high, shape), axis=2)  # [blocks, k, block_n]
            parts.append(op.Reshape(op.Transpose(block, perm=[0, 2, 1]), op.Constant(value_ints=[main, k])))
        if tail:  # per input channel: rows 2j (low nibble) and 2j + 1 (high)
            shape = op.Constant(value_ints=[k, tail // 2, 1])
            pairs = op.Concat(op.Reshape(low_tail, shape), op.Reshape(high_tail, shape), axis=2)  # [k, tail/2, 2]
            parts.append(op.Transpose(op.Reshape(pairs, op.Constant(value_ints=[k, tail])), perm=[1, 0]))
        return parts[0] if len(parts) == 1 else op.Concat(*parts, axis=0)

    def c(values: list[int]) -> Any:
        return op.Constant(value_ints=values)

    def int4_mm(x: Any, weight: Any, group_size: int, scales_and_zeros: Any) -> Any:
        n, k = int(weight.shape[0]), 2 * int(weight.shape[1])
        groups = k // group_size
        sz = op.Cast(op.Cast(scales_and_zeros, to=BF16), to=FLOAT)  # the kernel reads bf16 scales and zeros
        scale = op.Gather(sz, op.Constant(value_int=0), axis=2)  # [groups, n]
        zero = op.Gather(sz, op.Constant(value_int=1), axis=2)
        x32 = op.Cast(op.Cast(x, to=BF16), to=FLOAT)  # and bf16 activations
        # MatMulNBits computes x @ ((q - 8) * scale)^T (its default zero point is 8); the zeros add
        # sum(x over each group) @ zero.
        pairs = op.Reshape(unpack(weight), c([n, k // 2, 2]))
        low, high = (op.Gather(pairs, op.Constant(value_int=i), axis=2) for i in (0, 1))
        four = op.Constant(value=ir.tensor(np.array(4, np.uint8)))
        blob = op.Reshape(op.BitwiseOr(low, op.BitShift(high, four, direction="LEFT")), c([n, groups, group_size // 2]))
        scales = op.Reshape(op.Transpose(scale, perm=[1, 0]), c([-1]))
        main = matmul_nbits(x32, blob, scales, K=k, N=n, bits=4, block_size=group_size)
        sums = op.ReduceSum(op.Reshape(x32, c([-1, groups, group_size])), c([2]), keepdims=0)
        out = op.Add(main, op.MatMul(sums, zero))
        return op.CastLike(op.Cast(out, to=BF16), x)  # rounded to bf16, as the kernel returns

    table: dict[Any, Callable[..., Any]] = {torch.ops.aten._weight_int4pack_mm_for_cpu.default: int4_mm}
    import opus.quant.formats.w4a16  # noqa: F401 - registers opus::int4_mm_cpu

    table[torch.ops.opus.int4_mm_cpu.default] = int4_mm
    return table


def _matmul_nbits_schema() -> Any:
    """onnxruntime's com.microsoft MatMulNBits (inputs and attributes used here), which ONNX does not register."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    ints = OpSchema.AttrType.INT
    return OpSchema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[param("A", "T1"), param("B", "T2"), param("scales", "T1")], outputs=[param("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], "")],
        attributes=[OpSchema.Attribute(name, ints, "") for name in ("K", "N", "bits", "block_size")])


def optimize(model: Any) -> None:
    """What the exporter's optimizer does (onnxscript ``optimize_ir``) but its pattern rewrites, in place on an
    ``onnx_ir`` model: one of them (SlicesSplit) scans the whole graph for every node, quadratic in the node
    count — minutes on a quantized MoE — and onnxruntime rewrites the graph itself when a session loads."""
    from onnx_ir.passes import common
    from onnxscript.optimizer import fold_constants

    common.InlinePass()(model)
    for _ in range(2):
        fold_constants(model, onnx_shape_inference=True)
        common.RemoveUnusedNodesPass()(model)
    for step in (common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass(),
                 common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
                 common.LiftSubgraphInitializersToMainGraphPass(), common.DeduplicateInitializersPass(),
                 common.CommonSubexpressionEliminationPass(), common.OutputFixPass(), common.NameFixPass()):
        step(model)


def rewrite(path: Path, dim_names: dict[str, dict[int, str]], float32: bool) -> None:
    """Name the inputs' dynamic axes (``dim_names``: input -> axis -> name); with ``float32``, make every
    bf16 value of the graph float32. The external data file is left as it is."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for value in model.graph.input:
        for axis, name in dim_names.get(value.name, {}).items():
            value.type.tensor_type.shape.dim[axis].dim_param = name
    if float32:
        compute_in_float32(model)
    onnx.save_model(model, str(path))


def compute_in_float32(model: Any) -> None:
    """Every bf16 value of ``model`` (an ``onnx.ModelProto``) becomes float32; bf16 initializers are cast."""
    import onnx
    from onnx import TensorProto, numpy_helper

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT

    def to_float(tensor: onnx.TensorProto) -> onnx.TensorProto:
        if tensor.data_type != bf16:
            return tensor
        return numpy_helper.from_array(numpy_helper.to_array(tensor).astype("float32"), tensor.name)

    def fix_types(values: Any) -> None:
        for value in values:
            tensor_type = value.type.tensor_type
            if tensor_type.elem_type == bf16:
                tensor_type.elem_type = f32

    def fix_nodes(nodes: Any) -> None:
        for node in nodes:
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i == bf16:
                    attr.i = f32
                elif attr.type == onnx.AttributeProto.TENSOR:
                    attr.t.CopyFrom(to_float(attr.t))
                elif attr.type == onnx.AttributeProto.GRAPH:
                    fix_graph(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        fix_graph(g)

    def fix_graph(graph: onnx.GraphProto) -> None:
        fix_types([*graph.input, *graph.output, *graph.value_info])
        fix_nodes(graph.node)
        casts = []
        for init in graph.initializer:
            if init.data_type == bf16:  # stored bf16, cast to float32 once (onnxruntime folds it at load)
                name, init.name = init.name, f"{init.name}__bf16"
                casts.append(onnx.helper.make_node("Cast", [init.name], [name], to=f32, name=f"{name}__to_f32"))
        if casts:
            nodes = list(graph.node)
            del graph.node[:]
            graph.node.extend([*casts, *nodes])

    fix_graph(model.graph)
    for function in model.functions:
        fix_nodes(function.node)
        fix_types(function.value_info)
