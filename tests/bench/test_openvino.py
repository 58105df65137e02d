"""The OpenVINO contenders: a stateful graph behind the engine's interface computes what Opus's decoder does."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opus.bench import openvino_contender as ov_contender
from opus.bench.core import Unavailable
from opus.runtime.engine import generate
from tests.quant.tiny import blocks, tiny_decoder


def _ctx(model: torch.nn.Module, work: Path) -> SimpleNamespace:
    return SimpleNamespace(load=lambda dtype="float32": model, work_dir=work, shared={}, threads=1, device="cpu")


def test_without_openvino_the_contenders_say_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(Unavailable, match=r"pip install 'opus\[openvino\]'"):
        ov_contender.ov_int8(_ctx(tiny_decoder("llama"), tmp_path))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_the_stateful_graph_generates_what_the_decoder_does(family: str, tmp_path: Path) -> None:
    pytest.importorskip("openvino", reason="OpenVINO is an optional extra (pip install 'opus[openvino]')")
    pytest.importorskip("nncf", reason="OpenVINO is an optional extra (pip install 'opus[openvino]')")
    model = tiny_decoder(family)
    ctx = _ctx(model, tmp_path)
    fp32, int8, default = ov_contender.ov_fp32(ctx), ov_contender.ov_int8(ctx), ov_contender.ov_default(ctx)
    assert ctx.shared["openvino-onnx"]["paths"]["last"].is_file()  # one export, shared
    # The f32 row asks for it; the others run what OpenVINO picks for this CPU (bf16 with AVX-512 BF16 or AMX),
    # as its users get it, and say so.
    assert "inference precision f32 (forced, not OpenVINO's default)" in fp32.notes[0]
    assert all("(OpenVINO's default for this CPU)" in built.notes[0] for built in (int8, default))
    want = generate(model, blocks(2, 12), 6).tokens
    assert generate(default.model, blocks(2, 12), 6, default.factory).tokens.shape == want.shape
    for prompts in (blocks(2, 12), blocks(3, 7, seed=1)):  # a new batch size: the state starts afresh
        want = generate(model, prompts, 6).tokens
        assert torch.equal(generate(fp32.model, prompts, 6, fp32.factory).tokens, want)
    ids = blocks(2, 12)
    with torch.no_grad():
        reference = model(ids)
    assert torch.allclose(fp32.model(ids), reference, atol=1e-4)  # every position, no state kept
    quantized = int8.model(ids)
    # int8 weights: close, not equal. (A random MoE router's near-ties flip under any int8 weights: dense only.)
    error = (quantized - reference).abs().max()
    assert error > 0 and (family != "llama" or error < 0.05 * reference.abs().max())
    assert int8.metrics["model_mb"] < 0.5 * fp32.metrics["model_mb"]
    assert any("INT8_ASYM" in note for note in int8.notes) and any("stateful" in note for note in fp32.notes)
    with pytest.raises(ValueError, match="state holds 0 positions"):
        fp32.model(ids[:, :1], cache=fp32.factory(2, 8), start_pos=3, last_only=True)
