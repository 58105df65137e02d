"""A fused model is rebuilt from recipe + tensors exactly; compile is re-applied from the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from fusion_kit import prompts, tiny_lm

from opus.fusion import FusionConfig, apply_fusion, decide_compile, fuse_model, lm_probe
from opus.models.saved_state import changed_tensors
from opus.pipeline.spec import load_pipeline
from opus.pipeline.state import STATE_FILE, TENSORS_FILE, materialize
from opus.recipe import apply_step

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe"])
def test_replay_gives_the_same_structure_and_logits(family):
    model = tiny_lm(family)
    outcome = fuse_model(model, FusionConfig(), lm_probe(prompts()[:1, :8]))
    step = outcome.step()
    rebuilt = apply_step(tiny_lm(family, seed=5), step)  # other base weights: the tensors decide
    fused_sd = outcome.model.state_dict()
    assert rebuilt.state_dict().keys() == fused_sd.keys()
    rebuilt.load_state_dict(fused_sd)
    ids = prompts()
    with torch.inference_mode():
        assert torch.equal(rebuilt(ids), outcome.model(ids))


def test_checkpoint_round_trip_through_materialize(tmp_path):
    import fusion_kit
    from safetensors.torch import save_file

    (tmp_path / "fusion_kit.py").write_text(Path(fusion_kit.__file__).read_text())
    spec_path = tmp_path / "pipeline.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "t", "stages": [{"id": "f", "uses": "fuse"}], "model": {
        "factory": "fusion_kit:tiny_lm", "args": {"family": "mixtral"}}}))
    loaded = load_pipeline(spec_path)
    base = materialize(None, loaded.spec, loaded.base_dir)
    outcome = fuse_model(base.model, FusionConfig(), lm_probe(prompts()[:1, :8]))
    with torch.no_grad():  # a later stage changed a fused tensor: the checkpoint must carry it
        outcome.model.model.layers[1].self_attn.qkv_proj.weight.mul_(1.5)
    tensors, aliases = changed_tensors(outcome.model, base.base_marks)
    assert "model.layers.0.mlp.experts.gate_up.weight" in tensors
    assert not any(name.endswith("o_proj.weight") for name in tensors)  # untouched: not saved again
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(tensors, str(ckpt / TENSORS_FILE))
    state = {"source": loaded.spec.model.source(), "recipe": [outcome.step().as_json()], "tensors": TENSORS_FILE,
             "aliases": aliases}
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    again = materialize(ckpt, loaded.spec, loaded.base_dir).model
    ids = prompts()
    with torch.inference_mode():
        assert torch.equal(again(ids), outcome.model(ids))


def test_compile_is_measured_and_replayed():
    model = tiny_lm("llama")
    ids = prompts(1, 8)
    outcome = fuse_model(model, FusionConfig(), lm_probe(ids))
    settings = {"backend": "eager", "mode": None, "dynamic": None}
    decision = decide_compile(outcome.model, ids, settings, steps=2)
    assert decision.eager_ms > 0 and decision.reason
    assert (outcome.model._compiled_call_impl is not None) == decision.kept
    step = outcome.step(settings)  # as if kept: replay compiles again, names and outputs unchanged
    rebuilt = apply_fusion(tiny_lm("llama"), step)
    assert rebuilt._compiled_call_impl is not None
    with torch.inference_mode():
        assert torch.allclose(rebuilt(ids), outcome.model(ids), atol=1e-5)
    assert rebuilt.state_dict().keys() == outcome.model.state_dict().keys()


def test_replay_names_a_region_the_model_lacks():
    outcome = fuse_model(tiny_lm("llama"), FusionConfig(), lm_probe(prompts()[:1, :8]))
    with pytest.raises(ValueError, match="model.layers.1"):
        apply_fusion(tiny_lm("llama", layers=1), outcome.step())
