"""The W8A8 experts' C++ op (opus.fusion.native_experts) computes what the sorted mode's Python path computes,
bit for bit: every branch (int8 GEMM, weight-only rows, a packed kernel), in pieces and blocks, on one thread
and two, eagerly and inside a compiled graph; where it cannot run it says why and the Python path runs."""

from __future__ import annotations

import pytest
import torch
from fusion_kit import prompts, tiny_lm

from opus.fusion import native_experts
from opus.fusion.moe import GroupedMoE, group_moe
from opus.quant import packed
from tests.native_kit import built_or_skip


@pytest.fixture(autouse=True)
def _built() -> None:  # skipped without a compiler; with one, a failed build fails
    built_or_skip(native_experts.load, "the C++ experts op")


def _moe(fmt: str = "w8a8", hidden: int = 32, inter: int = 32) -> GroupedMoE:
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats

    model = tiny_lm("mixtral", layers=1, hidden_size=hidden, moe_intermediate_size=inter)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n]
    quantize_model(model, dict.fromkeys(names, fmt), collect_stats(model, prompts()), group_size=32)
    grouped = group_moe(model.model.layers[0].mlp)
    assert isinstance(grouped, GroupedMoE)
    return grouped


def _routing(tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts 0-2 take most tokens (several 256-row pieces each); expert 3 only the first five tokens, so
    it runs the weight-only branch (at most 16 rows)."""
    gen = torch.Generator().manual_seed(5)
    t = torch.arange(tokens)
    first = t % 3
    second = torch.where(t < 5, torch.full_like(t, 3), (first + 1) % 3)
    chosen = torch.stack([first, second], 1)
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1)
    return torch.randn(tokens, hidden, generator=gen), chosen, weights


def _python_path(moe: GroupedMoE, monkeypatch: pytest.MonkeyPatch, *args: torch.Tensor) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(moe.experts, "_native_reason", "the Python path, for reference")
        return moe.experts.sorted(*args)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_op_equals_the_python_sorted_mode_bit_for_bit(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe()
    args = _routing(900, 32)
    assert moe.experts.native_reason(args[0]) is None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            assert torch.equal(moe.experts.sorted(*args), _python_path(moe, monkeypatch, *args))
    finally:
        torch.set_num_threads(before)


def test_an_intermediate_size_off_the_vector_width_agrees_within_a_quantization_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """24 is not a multiple of ATen's 16-float vectors: its silu computes a row's last 8 values by the scalar
    path, and where the rows fall on the threads decides which; a value one ulp apart may round to the
    neighbouring int8 step. Bit for bit where the vector width divides the intermediate size (above)."""
    moe = _moe(inter=24)
    args = _routing(900, 32)
    with torch.no_grad():
        got, want = moe.experts.sorted(*args), _python_path(moe, monkeypatch, *args)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))


def test_tokens_in_several_blocks_equal_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide hidden size: 8 MB of expert outputs hold 1,024 tokens, so 2,500 tokens run as three blocks."""
    moe = _moe(hidden=1024)
    args = _routing(2500, 1024)
    with torch.no_grad():
        assert torch.equal(moe.experts.sorted(*args), _python_path(moe, monkeypatch, *args))


def test_a_packed_kernel_in_use_is_the_ops_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    if packed.kernel_named("fbgemm").available() is not None:
        pytest.skip(f"FBGEMM cannot serve here: {packed.kernel_named('fbgemm').available()}")
    moe = _moe()
    args = _routing(300, 32)
    with torch.no_grad(), packed.use("fbgemm"):
        got = moe.experts.sorted(*args)
        assert torch.equal(got, _python_path(moe, monkeypatch, *args))
    assert not torch.equal(got, moe.experts.sorted(*args))  # FBGEMM rounds its scales otherwise: it did run


def test_a_compiled_graph_calls_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe()
    x, chosen, weights = _routing(200, 32)
    calls: list[int] = []
    real = native_experts.sorted_w8a8
    monkeypatch.setattr(native_experts, "sorted_w8a8", lambda *a: calls.append(1) or real(*a))
    compiled = torch.compile(lambda *a: moe.experts.run(*a, "sorted"), fullgraph=True)
    with torch.no_grad():
        got = compiled(x, chosen, weights)
    assert calls  # traced through the op, in one graph (fullgraph)
    assert torch.equal(got, _python_path(moe, monkeypatch, x, chosen, weights))


def test_where_the_op_cannot_run_it_says_why_and_python_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    w8a16 = _moe("w8a16")
    x, chosen, weights = _routing(40, 32)
    assert w8a16.experts.native_reason(x) == "the C++ experts op runs W8A8 experts only"
    assert "fp32 on the CPU" in str(_moe().experts.native_reason(x.bfloat16()))
    monkeypatch.setattr(native_experts, "_STATE", {})
    monkeypatch.setenv("OPUS_NATIVE_OPS", "0")
    moe = _moe()
    assert moe.experts.native_reason(x) == "OPUS_NATIVE_OPS=0"
    called = []
    monkeypatch.setattr(native_experts, "sorted_w8a8", lambda *a: called.append(1))
    with torch.no_grad():
        assert moe.experts.sorted(x, chosen, weights).shape == x.shape
    assert not called


def test_a_copied_moe_runs_its_own_experts_in_a_compiled_graph() -> None:
    """opus::sorted_experts finds experts by handle: a deep copy gets its own, so changing the copy's weights
    changes what the copy computes and not what the original computes."""
    import copy

    moe = _moe()
    twin = copy.deepcopy(moe)
    assert twin.experts.handle != moe.experts.handle
    x, chosen, weights = _routing(100, 32)
    with torch.no_grad():
        before = moe.experts.run(x, chosen, weights, "sorted")
        for layer in twin.experts.gate_up.experts:
            layer.qweight.neg_()
        from opus.fusion.moe import sorted_experts

        assert torch.equal(sorted_experts(x, chosen, weights, moe.experts.handle, False), before)
        assert not torch.equal(sorted_experts(x, chosen, weights, twin.experts.handle, False), before)
