"""A checkpoint written by the code before the package move still loads and computes the same."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from opus.atomic import read_json
from opus.kv.cache import cache_factory
from opus.kv.choice import cache_config_from_recipe
from opus.models import load_model
from opus.models.saved_state import apply_state
from opus.runtime.engine import full_logits, generate

LEGACY = Path(__file__).parents[1] / "fixtures" / "legacy"


def _rebuilt():
    state = read_json(LEGACY / "checkpoint" / "state.json")
    model, tokenizer = load_model(state["source"], LEGACY, dtype="float32", device="cpu")
    return apply_state(model, tokenizer, state, LEGACY / "checkpoint", "cpu").model, state


def test_old_checkpoint_rebuilds_to_the_same_logits_and_tokens() -> None:
    model, state = _rebuilt()
    reference = load_file(str(LEGACY / "reference.safetensors"))
    ids = reference["input_ids"]
    with torch.inference_mode():
        logits = full_logits(model, ids)[:, -4:]
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=1e-4)
    config = cache_config_from_recipe(state["recipe"])
    assert config["provider"] == "opus.static_cache"  # the old module path, as written then
    result = generate(model, ids, 8, cache_factory(model, config), return_logits=True)
    assert torch.equal(result.tokens, reference["tokens"])
    torch.testing.assert_close(result.logits, reference["decode_logits"], atol=1e-4, rtol=1e-4)
