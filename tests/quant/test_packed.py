"""W8A8's int8 GEMM through a packed kernel, oneDNN's or FBGEMM's (opus.quant.packed)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from opus.quant import packed
from opus.quant.fbgemm import FBGEMM
from opus.quant.formats.w8a8 import Int8DynamicLinear, int8_activations_from
from opus.quant.onednn import ONEDNN

KERNELS = [pytest.param(kernel, id=kernel.name,
                        marks=pytest.mark.skipif(kernel.available() is not None, reason=f"{kernel.available()}"))
           for kernel in (ONEDNN, FBGEMM)]


def _layer(seed: int = 0, rows_in: int = 96, rows_out: int = 80) -> Int8DynamicLinear:
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(rows_in, rows_out)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(rows_out, rows_in, generator=generator))
    return Int8DynamicLinear.from_linear(linear)


def _packed_calls(fn, kernel: packed.PackedKernel) -> int:  # noqa: ANN001 - any callable
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if f"{kernel.name}_int8_linear" in event.key)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_it_is_asked_for_and_agrees_with_int_mm(kernel: packed.PackedKernel, rows: int) -> None:
    layer = _layer()
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    assert packed.active() is None  # off unless asked for: the eager paths keep _int_mm
    with torch.no_grad(), int8_activations_from(0):  # int8 activations from one row on
        unpacked = layer(x)
        assert _packed_calls(lambda: layer(x), kernel) == 0
        with packed.use(kernel.name):
            assert packed.active() is kernel
            got = layer(x)
            assert _packed_calls(lambda: layer(x), kernel) == 1
    assert got.abs().max() > 1
    torch.testing.assert_close(got, unpacked, rtol=1e-5, atol=1e-5)


def test_the_kernels_agree_with_int_mm_at_the_int8_extremes() -> None:
    """Every product sum at its largest: a kernel that saturated 16-bit pair sums would be off."""
    q = torch.full((2, 128), 127, dtype=torch.int8)
    q[1] = -127
    qweight = torch.full((16, 128), 127, dtype=torch.int8)
    qweight[8:] = -127
    scale = torch.full((16,), 0.5)
    want = torch._int_mm(q, qweight.t()).float() * scale
    for kernel in (ONEDNN, FBGEMM):
        if kernel.available() is None:
            torch.testing.assert_close(kernel.linear(q, qweight, scale), want, rtol=0, atol=0)
            kernel.twins.pop(qweight, None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_weight_is_packed_once_and_its_twin_goes_with_it(kernel: packed.PackedKernel) -> None:
    layer = _layer(2)
    before = packed.packed_bytes()
    x = torch.randn(24, 96)
    with torch.no_grad(), packed.use(kernel.name):
        for _ in range(3):
            layer(x)
    assert packed.packed_bytes() - before >= 96 * 80  # one packed twin of the 80 × 96 int8 weight
    grown = packed.packed_bytes()
    with torch.no_grad(), packed.use(kernel.name):
        layer(x)
    assert packed.packed_bytes() == grown
    del layer
    gc.collect()
    assert packed.packed_bytes() == before


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_compiled_graph_calls_the_packed_kernel_and_follows_the_switch(kernel: packed.PackedKernel) -> None:
    layer = _layer(3)
    x = torch.randn(32, 96)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        eager = layer(x)
        with packed.use(kernel.name):
            torch.testing.assert_close(compiled(x), eager, rtol=1e-5, atol=1e-4)  # traced here
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                compiled(x)
            calls = [e for e in prof.events() if e.name == f"opus::{kernel.name}_int8_linear"]
            # one call, the values as the kernel takes them (FBGEMM: floats), cast inside the graph
            taken = {torch.int8: "signed char", torch.float32: "float"}[kernel.takes]
            assert [e.input_dtypes[0] for e in calls] == [taken]
        # the choice is guarded: the graph is traced again without the packed kernel
        torch.testing.assert_close(compiled(x), eager, rtol=1e-5, atol=1e-5)
        assert _packed_calls(lambda: compiled(x), kernel) == 0


def test_exported_graphs_keep_the_portable_int8_gemm() -> None:
    """torch.export (ONNX, the native export) cannot hold a packed weight: it sees _int_mm."""
    layer = _layer(4)
    for kernel in (ONEDNN, FBGEMM):
        if kernel.available() is not None:
            continue
        with torch.no_grad(), packed.use(kernel.name):
            program = torch.export.export(layer, (torch.randn(32, 96),))
        targets = {str(node.target) for node in program.graph.nodes}
        assert "aten._int_mm.default" in targets
        assert not any("int8_linear" in target for target in targets)


def test_use_refuses_where_the_kernel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FBGEMM, "checked", ["this torch has no FBGEMM"])
    with pytest.raises(ValueError, match="no FBGEMM"), packed.use("fbgemm"):
        pass
    named = "no packed int8 GEMM named 'mkl'; there are fbgemm, onednn"
    with pytest.raises(ValueError, match=named), packed.use("mkl"):
        pass
    with packed.use(None):
        assert packed.active() is None


def test_a_kernel_that_disagrees_with_int_mm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """As 8-bit activations through AVX2's saturating pair sums would: wrong at the extremes only."""
    if FBGEMM.missing() is not None:
        pytest.skip(FBGEMM.missing())
    run = FBGEMM.run
    monkeypatch.setattr(FBGEMM, "run", lambda q, twin, scale: run(q, twin, scale).clamp(-30000, 30000))
    monkeypatch.setattr(FBGEMM, "checked", [])
    assert FBGEMM.available() == "FBGEMM's int8 linear disagrees with torch._int_mm here"


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_long_prefill_is_one_packed_call(kernel: packed.PackedKernel) -> None:
    """``_int_mm`` runs rows in chunks (its int32 accumulator); a packed kernel writes fp32 at once."""
    layer = _layer(5)
    x = torch.randn(Int8DynamicLinear.CHUNK_ROWS + 64, 96)
    with torch.no_grad():
        unpacked = layer(x)
        with packed.use(kernel.name):
            assert _packed_calls(lambda: layer(x), kernel) == 1
            torch.testing.assert_close(layer(x), unpacked, rtol=1e-5, atol=1e-5)


def test_onednns_reference_matmul_is_told_apart_from_its_optimized_kernels() -> None:
    """Where oneDNN runs its packed int8 GEMM through the reference implementation (an AMD EPYC with
    AVX-512 VNNI: 67 ms a small GEMM), the kernel is unavailable with that reason, so kv_config never
    spends minutes timing it."""
    from opus.quant.onednn import reference_implementation

    head = "onednn_verbose,v1,primitive,exec,cpu,matmul,"
    tail = ",undef,src:s8:a:blocked:ab::f0 wei:s8::blocked:BA16a64b4a::f8:zpm2 dst:f32,,64x256:256x384,67.1"
    assert reference_implementation("onednn_verbose,v1,info,cpu,runtime:OpenMP\n" + head + "ref_int8:any" + tail) \
        == "ref_int8:any"
    assert reference_implementation(head + "brg_matmul:avx512_core_amx" + tail) is None
    assert reference_implementation("onednn_verbose,v1,info,oneDNN v3.12.0") is None


def test_the_verbose_check_reads_a_real_matmul_and_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    from opus.quant.onednn import _verbose_of_one_call, reference_implementation

    if not hasattr(torch.ops.onednn, "qlinear_prepack"):
        pytest.skip("this torch has no oneDNN int8 linear")
    lines = _verbose_of_one_call()
    assert ",primitive,exec,cpu,matmul," in lines
    assert "onednn_verbose" not in capfd.readouterr().out
    implementation = reference_implementation(lines)
    assert (implementation in str(ONEDNN.race_reason())) if implementation else ONEDNN.race_reason() is None


def test_a_correct_but_slow_kernel_is_left_out_of_races_and_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Correct here but on a reference path: kv_config's candidates skip it with the reason, while the
    kernel itself still serves whoever asks for it (its tests keep running on such a CPU)."""
    from opus.kv.kernel_choices import choice

    kernel = next((k for k in (ONEDNN, FBGEMM) if k.available() is None), None)
    if kernel is None:
        pytest.skip("no packed kernel serves here")
    monkeypatch.setattr(kernel, "checked", [None, "a reference path (the test's)"])
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), _layer())
    value = {"prefill": kernel.name, "decode": kernel.name}
    assert choice("w8a8_packed_gemm").reason(model, value) == "a reference path (the test's)"
    x = torch.randn(20, 96)
    with packed.use(kernel.name):
        assert _packed_calls(lambda: model[1](x), kernel) == 1
