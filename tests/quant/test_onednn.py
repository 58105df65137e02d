"""The W8A8 int8 GEMM through oneDNN's packed kernel (opus.quant.onednn)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from opus.quant import onednn
from opus.quant.formats.w8a8 import Int8DynamicLinear

pytestmark = pytest.mark.skipif(onednn.available() is not None, reason=f"{onednn.available()}")


def _layer(seed: int = 0, rows_in: int = 96, rows_out: int = 80) -> Int8DynamicLinear:
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(rows_in, rows_out)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(rows_out, rows_in, generator=generator))
    return Int8DynamicLinear.from_linear(linear)


def _packed_calls(fn) -> int:  # noqa: ANN001 - any callable
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if "onednn_int8_linear" in event.key)


def test_it_is_asked_for_and_agrees_with_int_mm() -> None:
    layer = _layer()
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    assert not onednn.active()  # off unless asked for: the eager paths keep _int_mm
    with torch.no_grad():
        unpacked = layer(x)
        assert _packed_calls(lambda: layer(x)) == 0
        with onednn.use():
            packed = layer(x)
            assert _packed_calls(lambda: layer(x)) == 1
    assert packed.abs().max() > 1
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-5)


def test_a_weight_is_packed_once_and_its_twin_goes_with_it() -> None:
    layer = _layer(2)
    before = onednn.packed_bytes()
    x = torch.randn(24, 96)
    with torch.no_grad(), onednn.use():
        for _ in range(3):
            layer(x)
    assert onednn.packed_bytes() - before >= 96 * 80  # one packed twin of the 80 × 96 int8 weight
    grown = onednn.packed_bytes()
    with torch.no_grad(), onednn.use():
        layer(x)
    assert onednn.packed_bytes() == grown
    del layer
    gc.collect()
    assert onednn.packed_bytes() == before


def test_a_compiled_graph_calls_the_packed_kernel_and_follows_the_switch() -> None:
    layer = _layer(3)
    x = torch.randn(32, 96)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        eager = layer(x)
        with onednn.use():
            torch.testing.assert_close(compiled(x), eager, rtol=1e-5, atol=1e-4)  # traced here
            assert _packed_calls(lambda: compiled(x)) == 1
        # the flag is guarded: the graph is traced again without the packed kernel
        torch.testing.assert_close(compiled(x), eager, rtol=1e-5, atol=1e-5)
        assert _packed_calls(lambda: compiled(x)) == 0


def test_exported_graphs_keep_the_portable_int8_gemm() -> None:
    """torch.export (ONNX, the native export) cannot hold a oneDNN-packed weight: it sees _int_mm."""
    layer = _layer(4)
    with torch.no_grad(), onednn.use():
        program = torch.export.export(layer, (torch.randn(32, 96),))
    targets = {str(node.target) for node in program.graph.nodes}
    assert "aten._int_mm.default" in targets
    assert not any("onednn" in target for target in targets)


def test_use_refuses_where_the_kernel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn, "available", lambda: "this torch has no oneDNN int8 linear")
    with pytest.raises(ValueError, match="no oneDNN int8 linear"), onednn.use():
        pass
    with onednn.use(False):
        assert not onednn.active()


def test_a_long_prefill_is_one_packed_call() -> None:
    """``_int_mm`` runs rows in chunks (its int32 accumulator); the packed kernel writes fp32 at once."""
    layer = _layer(5)
    x = torch.randn(Int8DynamicLinear.CHUNK_ROWS + 64, 96)
    with torch.no_grad():
        unpacked = layer(x)
        with onednn.use():
            assert _packed_calls(lambda: layer(x)) == 1
            torch.testing.assert_close(layer(x), unpacked, rtol=1e-5, atol=1e-5)
