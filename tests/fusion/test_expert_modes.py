"""The grouped MoE's execution modes compute what SparseMoE computes; the choice is measured, recorded
and replayed; modes that cannot run say why."""

from __future__ import annotations

import warnings

import pytest
import torch
from fusion_kit import prompts, tiny_lm

from opus.fusion import FusionConfig, apply_fusion, fuse_model, linear_ops, lm_probe
from opus.fusion.expert_modes import availability, decide_expert_modes, replay_expert_modes
from opus.fusion.moe import EXPERT_MODES, GroupedMoE, group_moe, grouped_moes

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("shape", [(2, 7), (3, 1)])  # prefill and decode sized
def test_every_mode_equals_the_looped_experts(family: str, shape: tuple[int, int]) -> None:
    moe = tiny_lm(family).model.layers[1].mlp
    x = torch.randn(*shape, 32, generator=torch.Generator().manual_seed(3))
    grouped = group_moe(moe)
    assert isinstance(grouped, GroupedMoE)
    with torch.no_grad():
        expected = moe(x)
        for mode in EXPERT_MODES:  # grouped runs on this CPU build (torch._grouped_mm)
            assert grouped.mode_reason(mode) is None, mode
            torch.testing.assert_close(grouped(x, mode), expected, rtol=1e-5, atol=1e-5, msg=mode)


def test_biased_experts_in_every_mode() -> None:
    moe = tiny_lm("mixtral").model.layers[0].mlp
    for expert in moe.experts:
        for linear in (expert.gate_proj, expert.up_proj, expert.down_proj):
            linear.bias = torch.nn.Parameter(0.1 * torch.randn(linear.out_features))
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(4))
    grouped = group_moe(moe)
    with torch.no_grad():
        for mode in EXPERT_MODES:
            torch.testing.assert_close(grouped(x, mode), moe(x), rtol=1e-5, atol=1e-5, msg=mode)


def test_unavailable_mode_says_why_and_refuses(monkeypatch) -> None:
    model = fuse_model(tiny_lm("mixtral"), FusionConfig(patterns=["moe_grouped"]), lm_probe(prompts()[:1, :8])).model
    monkeypatch.setitem(linear_ops._GROUPED_OK, ("cpu", torch.float32), False)
    monkeypatch.setitem(linear_ops._GROUPED_WHY, ("cpu", torch.float32), "no grouped GEMM in this build")
    runnable, unavailable = availability(model)
    assert runnable == ["sorted", "dense", "compiled"]
    assert unavailable["grouped"] == "model.layers.0.mlp: no grouped GEMM in this build"
    moe = grouped_moes(model)[0][1]
    with pytest.raises(ValueError, match="no grouped GEMM"):
        moe(torch.randn(2, 3, 32), "grouped")


def _w8a8_moe(fmt: str = "w8a8") -> GroupedMoE:
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats

    model = tiny_lm("mixtral")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n]
    quantize_model(model, dict.fromkeys(names, fmt), collect_stats(model, prompts()), group_size=32)
    grouped = group_moe(model.model.layers[0].mlp)
    assert isinstance(grouped, GroupedMoE)
    return grouped


@pytest.mark.parametrize("fmt", ["w8a8", "w8a16"])
def test_the_dense_mode_runs_every_quantized_experts_gate_up_in_one_call(fmt: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense: every expert sees every row, so their gate/up layers run as one concatenated layer: the same
    sums as one call per expert, bit for bit, at decode and prefill sizes; the copy is not in the state dict."""
    moe = _w8a8_moe(fmt)
    merged = moe.experts.gate_up_all
    assert merged is not None and merged.out_features == moe.experts.num_experts * moe.experts.gate_up.out_features
    assert not [name for name in moe.state_dict() if "gate_up_all" in name]
    calls: list[int] = []
    for expert in moe.experts.gate_up.experts:
        monkeypatch.setattr(expert, "forward", lambda x, real=expert.forward: calls.append(1) or real(x))
    for rows in (32, 5):
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            together = moe(x, "dense")
            assert calls == []  # the experts' own gate/up layers did not run
            moe.experts.gate_up_all = None
            apart = moe(x, "dense")
            moe.experts.gate_up_all = merged
        assert len(calls) == moe.experts.num_experts and torch.equal(together, apart)
        calls.clear()
    assert moe.experts.gate_up.merged(max_bytes=1024) is None  # bigger experts: no second copy


def test_compiled_mode_runs_quantized_experts_as_the_sorted_mode_does() -> None:
    """W8A8 experts in one compiled function per expert: the same sums as the sorted mode, whatever the
    slice sizes (a slice of a few rows runs the layer's own weight-only branch in both)."""
    moe = _w8a8_moe()
    assert moe.mode_reason("compiled") is None
    for rows in (64, 5):  # prefill-sized slices (compiled) and decode-sized ones (eager)
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            torch.testing.assert_close(moe(x, "compiled"), moe(x, "sorted"), rtol=0, atol=1e-6)


def test_compiled_mode_runs_a_layers_experts_in_one_compiled_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert with two rows or more: one compiled call for all of them (each call costs ~0.1 ms
    around it); an expert with one row: the experts one by one. The same sums as the sorted mode either way."""
    from opus.fusion import compiled_experts

    moe = _w8a8_moe()
    called: list[str] = []
    compile_for = compiled_experts._compiled
    monkeypatch.setattr(compiled_experts, "_compiled", lambda fn: called.append(fn.__name__) or compile_for(fn))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    chosen = torch.arange(128).remainder(4).view(64, 2)  # 32 rows for each of the 4 experts
    weights = torch.full((64, 2), 0.5)
    with torch.no_grad():
        one_call = moe.experts.run(x, chosen, weights, "compiled")
        assert called == ["_every_expert"]
        torch.testing.assert_close(one_call, moe.experts.run(x, chosen, weights, "sorted"), rtol=0, atol=1e-6)
        called.clear()
        chosen[0, 0], chosen[1:, :][chosen[1:, :] == 3] = 3, 0  # expert 3 gets one row
        chosen[1:, 1][chosen[1:, 0] == chosen[1:, 1]] = 1  # a token picks two different experts
        one_by_one = moe.experts.run(x, chosen, weights, "compiled")
        assert "_every_expert" not in called and called.count("_expert") == 3  # the 1-row expert runs eagerly
        torch.testing.assert_close(one_by_one, moe.experts.run(x, chosen, weights, "sorted"), rtol=0, atol=1e-6)


def test_compiled_mode_runs_eagerly_under_a_dispatch_mode() -> None:
    """The fuse stage counts dispatched ops under a TorchDispatchMode, where dynamo compiles nothing."""
    from opus.fusion.measure import count_ops

    moe = _w8a8_moe()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    seen = {}
    ops = count_ops(lambda: seen.update(out=moe(x, "compiled")))
    # the experts' int8 GEMMs ran, eagerly, under the counter (oneDNN's packed kernel, or _int_mm without it)
    assert ops["onednn_int8_linear"] + ops["_int_mm"] > 0
    with torch.no_grad():
        torch.testing.assert_close(seen["out"], moe(x, "sorted"), rtol=0, atol=1e-6)


def test_compiled_mode_says_where_it_cannot_run() -> None:
    from opus.fusion.compiled_experts import compiled_reason

    moe = _w8a8_moe("w8a16")
    assert moe.mode_reason("compiled") == "w8a16 experts have no pure kernel to compile"
    with pytest.raises(ValueError, match="no pure kernel"):
        moe(torch.randn(4, 32), "compiled")
    experts = _w8a8_moe().experts
    assert compiled_reason(experts.gate_up, experts.down, torch.device("cuda")) == (
        "compiled experts run on CPU (inductor's C++ kernels, measured there), not on cuda")


def test_choice_is_measured_per_phase_and_replays() -> None:
    model = tiny_lm("mixtral")
    ids = prompts()
    outcome = fuse_model(model, FusionConfig(patterns=["moe_grouped"]), lm_probe(ids[:1, :8]))
    choice = decide_expert_modes(outcome.model, ids, 4, rounds=2, steps=2)
    assert choice is not None and choice.runnable == list(EXPERT_MODES) and choice.unavailable == {}
    assert [d.what for d in choice.decisions] == ["MoE experts mode at prefill", "MoE experts mode at decode"]
    for decision in choice.decisions:
        assert list(decision.samples) == list(EXPERT_MODES)
        assert {len(rounds) for rounds in decision.samples.values()} in ({2}, {4})  # 4: measured once more
    assert choice.modes == {"prefill": choice.decisions[0].winner, "decode": choice.decisions[1].winner}
    assert all(m.modes == choice.modes for _, m in grouped_moes(outcome.model))
    step = outcome.step(None, choice.modes)
    assert step.experts == choice.modes
    rebuilt = apply_fusion(tiny_lm("mixtral", seed=5), step)
    rebuilt.load_state_dict(outcome.model.state_dict())
    assert all(m.modes == choice.modes for _, m in grouped_moes(rebuilt))
    with torch.inference_mode():
        torch.testing.assert_close(rebuilt(ids), outcome.model(ids))
    again = replay_expert_modes(rebuilt, {"modes": {"prefill": "dense", "decode": "grouped"}}, "earlier")
    assert again.modes == {"prefill": "dense", "decode": "grouped"} and again.decisions[0].replayed_from == "earlier"


def test_old_steps_run_the_default_and_unrunnable_modes_warn(monkeypatch) -> None:
    outcome = fuse_model(tiny_lm("mixtral"), FusionConfig(patterns=["moe_grouped"]), lm_probe(prompts()[:1, :8]))
    assert outcome.step().experts is None  # nothing chosen: the step is the one written before modes
    rebuilt = apply_fusion(tiny_lm("mixtral"), outcome.step())
    assert all(m.modes == {"prefill": "sorted", "decode": "sorted"} for _, m in grouped_moes(rebuilt))
    monkeypatch.setitem(linear_ops._GROUPED_OK, ("cpu", torch.float32), False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rebuilt = apply_fusion(tiny_lm("mixtral"), outcome.step(None, {"prefill": "grouped", "decode": "dense"}))
    assert any("prefill experts mode 'grouped' cannot run here" in str(w.message) for w in caught)
    assert all(m.modes == {"prefill": "sorted", "decode": "dense"} for _, m in grouped_moes(rebuilt))
    with pytest.raises(ValueError, match="unknown experts mode"):
        apply_fusion(tiny_lm("mixtral"), outcome.step(None, {"decode": "sparse"}))


def test_compiled_and_exported_paths_run_dense() -> None:
    """Under torch.compile every mode runs the static-shape dense path (what the static KV cache compiles)."""
    moe = group_moe(tiny_lm("mixtral").model.layers[0].mlp)
    x = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(lambda t: moe(t, "sorted"), backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), moe(x, "dense"), rtol=1e-5, atol=1e-5)


def test_prefill_is_timed_on_the_prompts_it_is_given() -> None:
    """The fuse stage hands the workload-shaped prompts for the prefill timing; the check of each mode
    still runs on the short prompts."""
    from opus.runtime.data import tiled

    ids = prompts()
    model = fuse_model(tiny_lm("mixtral"), FusionConfig(patterns=["moe_grouped"]), lm_probe(ids[:1, :8])).model
    workload = tiled(ids, 3, 2 * ids.shape[1] + 1)
    assert workload.shape == (3, 2 * ids.shape[1] + 1) and torch.equal(workload[:, : ids.shape[1]], ids[[0, 1, 0]])
    seen = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append((tuple(args[0].shape), kwargs.get(
        "last_only", False))), with_kwargs=True)
    decide_expert_modes(model, ids, 4, rounds=2, steps=2, wanted=["sorted", "dense"], prefill=workload)
    assert (tuple(workload.shape), True) in seen and (tuple(ids.shape), False) in seen


@pytest.mark.parametrize("fmt", ["w8a8", "w8a16"])
def test_a_reloaded_quantized_moe_runs_its_dense_mode_on_the_loaded_weights(fmt: str, tmp_path) -> None:
    """Every stage after fuse rebuilds the model (recipe on an empty structure, then the saved tensors):
    the merged gate/up layer, a derived copy, must be made from the loaded experts, not the empty ones. It
    was not: a reloaded K3 ran its compiled decode steps (dense mode) on zeros (free-running agreement
    0.19 while the teacher-forced one said 1.000)."""
    from safetensors.torch import save_file

    from opus.models.saved_state import apply_state, changed_tensors
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats

    def base() -> torch.nn.Module:
        return tiny_lm("mixtral")

    model = base()
    marks = {n: (t.data_ptr(), t._version) for n, t in model.state_dict(keep_vars=True).items()}
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n]
    quantized = quantize_model(model, dict.fromkeys(names, fmt), collect_stats(model, prompts()), group_size=32)
    outcome = fuse_model(model, FusionConfig(patterns=["moe_grouped"]), lm_probe(prompts()[:1, :8]))
    tensors, aliases = changed_tensors(outcome.model, marks)
    save_file(tensors, str(tmp_path / "t.safetensors"))
    state = {"recipe": [quantized, outcome.step()], "tensors": "t.safetensors", "aliases": aliases}
    reloaded = apply_state(base(), None, state, tmp_path, "cpu").model
    moe = grouped_moes(reloaded)[0][1]
    merged = moe.experts.gate_up_all
    assert merged is not None
    assert torch.equal(merged.qweight, torch.cat([e.qweight for e in moe.experts.gate_up.experts]))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(moe(x, "dense"), moe(x, "sorted"), rtol=1e-5, atol=1e-5)
        ids = prompts()[:2, :8]
        torch.testing.assert_close(reloaded(ids), outcome.model(ids), rtol=0, atol=0)
