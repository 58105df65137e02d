"""Recipe steps are typed documents: each kind's type reads what checkpoints store, old ones included,
and a malformed step is one line naming the kind and the field."""

from __future__ import annotations

import pytest

from opus.fusion.rewrite import FuseStep
from opus.kv.choice import KVCacheStep, KVSizing, cache_config_from_recipe, kv_cache_step, sizing_from_recipe
from opus.quant.apply import QuantizeStep
from opus.quant.tied import SharedEmbeddingStep
from opus.recipe import read_step, stored_recipe


def test_each_kind_reads_as_its_type_and_stores_as_it_read() -> None:
    stored = [{"kind": "quantize", "layers": {"model.layers.0.mlp.up_proj": {"format": "w4a16", "group_size": 64},
                                              "lm_head": {"format": "w8a8"}},
               "smoothing_alpha": {"model.layers.0.mlp.up_proj": 0.5}},
              {"kind": "shared_embedding", "version": 1, "embedding": "model.embed_tokens", "head": "lm_head"},
              {"kind": "fuse", "version": 1, "sites": [{"pattern": "rmsnorm", "region": "model.norm", "modules": []}],
               "ignored": [], "compile": {"backend": "inductor"}, "experts": {"decode": "dense"}},
              {"kind": "kv_cache", "cache": {"kind": "growing"},
               "sizing": {"kv_bytes_per_token": 64, "memory_budget_mb": 10.0, "context": 48, "max_context": 2048,
                          "max_batch": 8, "batch_size": 4}}]
    typed = [read_step(step) for step in stored]
    assert [type(s) for s in typed] == [QuantizeStep, SharedEmbeddingStep, FuseStep, KVCacheStep]
    layers = typed[0].layers
    assert layers["lm_head"].group_size is None and layers["model.layers.0.mlp.up_proj"].group_size == 64
    assert stored_recipe(stored) == stored  # nothing added, nothing lost
    assert sizing_from_recipe(stored) == KVSizing(**stored[3]["sizing"])
    assert cache_config_from_recipe([*stored, kv_cache_step({"kind": "pooled"})]) == {"kind": "pooled"}


def test_steps_written_before_a_field_existed_still_read() -> None:
    """A fuse step with ``compile: null`` and no ``experts`` (before expert modes), a kv_cache step without
    sizing, a quantize step without smoothing: as checkpoints of earlier sessions store them."""
    fuse = read_step({"kind": "fuse", "version": 1, "sites": [], "ignored": [], "compile": None})
    assert isinstance(fuse, FuseStep) and fuse.experts is None and fuse.compile is None
    assert sizing_from_recipe([{"kind": "kv_cache", "cache": {"kind": "growing"}}]) is None
    assert read_step({"kind": "quantize", "layers": {}}).smoothing_alpha == {}


@pytest.mark.parametrize(("step", "message"), [
    ({"kind": "quantize", "layers": {"lm_head": {"group_size": 32}}},
     "recipe step 'quantize': layers.lm_head.format: Field required"),
    ({"kind": "fuse", "version": 2}, "recipe step 'fuse': version: Value error, fuse step version 2 is not supported"),
    ({"kind": "kv_cache", "cache": {}, "sizing": {"max_batch": 3}},
     "recipe step 'kv_cache': sizing.kv_bytes_per_token"),
    ({"kind": "shared_embedding", "version": 1, "embeding": "x"},
     "recipe step 'shared_embedding': embeding: Extra inputs"),
    ({"kind": "prune"}, "recipe step of unknown kind 'prune' \\(known: .*fuse.*kv_cache"),
])
def test_a_malformed_step_is_one_line_naming_the_field(step: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_step(step)
