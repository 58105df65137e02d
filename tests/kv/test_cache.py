"""KV cache protocol, the growing baseline, the registry of kinds and the recipe step."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
import torch

from opus.kv import cache as kvcache
from opus.kv.cache import (
    GrowingKVCache,
    KVCache,
    cache_factory,
    make_cache,
    register_cache,
)
from opus.kv.choice import cache_config_from_recipe, kv_cache_step
from opus.models import DecoderLM, ModelConfig
from opus.recipe import apply_step
from opus.runtime.engine import generate


def tiny_llama() -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    return DecoderLM(cfg).eval()


class PreallocatedCache(kvcache.CacheBase):
    """A test-only second kind: fixed buffers written in place, as a kv_config stage might register."""

    def __init__(self, shape: kvcache.CacheShape) -> None:
        size = (shape.batch_size, shape.num_kv_heads, shape.max_seq_len, shape.head_dim)
        self.k = [torch.zeros(size, dtype=shape.dtype) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(size, dtype=shape.dtype) for _ in range(shape.num_layers)]
        self.lengths = [0] * shape.num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    @property
    def seq_len(self) -> int:
        return min(self.lengths)

    def reset(self) -> None:
        self.lengths = [0] * len(self.lengths)


@register_cache("test_preallocated")
def _preallocated(options: dict, shape: kvcache.CacheShape) -> KVCache:
    return PreallocatedCache(shape)


def test_growing_cache_appends_and_returns_everything() -> None:
    cache = GrowingKVCache(num_layers=2)
    assert isinstance(cache, KVCache)
    k1, v1 = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    for layer in range(2):
        k_all, v_all = cache.update(layer, k1, v1)
        assert torch.equal(k_all, k1) and torch.equal(v_all, v1)
    assert cache.seq_len == 4
    k2, v2 = torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 5)
    k_all, v_all = cache.update(0, k2, v2)
    assert torch.equal(k_all, torch.cat((k1, k2), dim=2)) and torch.equal(v_all, torch.cat((v1, v2), dim=2))
    assert cache.seq_len == 4  # layer 1 has not seen the new token yet
    cache.update(1, k2, v2)
    assert cache.seq_len == 5
    assert cache.nbytes() == 2 * 2 * (2 * 3 * 5 * 5) * 4
    cache.reset()
    assert cache.seq_len == 0


def test_make_cache_defaults_to_growing_and_rejects_unknown_kinds() -> None:
    assert isinstance(make_cache(None, None, 2, 16), GrowingKVCache)
    assert isinstance(make_cache({"kind": "growing"}, None, 2, 16), GrowingKVCache)
    with pytest.raises(ValueError, match="unknown KV cache kind 'nope'.*growing"):
        make_cache({"kind": "nope"}, None, 2, 16)
    with pytest.raises(ValueError, match="takes no options"):
        make_cache({"kind": "growing", "size": 3}, None, 2, 16)


def test_registered_kind_is_used_and_generates_the_same_tokens() -> None:
    model = tiny_llama()
    prompts = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(1))
    factory = cache_factory(model, {"kind": "test_preallocated"})
    assert isinstance(factory(2, 10), PreallocatedCache)
    expected = generate(model, prompts, 4).tokens
    assert torch.equal(generate(model, prompts, 4, factory).tokens, expected)


def test_provider_module_is_imported_on_demand(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_cache_kind.py").write_text(textwrap.dedent("""
        from opus.kv.cache import GrowingKVCache, register_cache

        @register_cache("from_provider")
        def build(options, shape):
            return GrowingKVCache(shape.num_layers)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"kind": "from_provider", "provider": "my_cache_kind"}
    assert isinstance(make_cache(config, None, 1, 4), GrowingKVCache)
    assert "my_cache_kind" in sys.modules


def test_recipe_step_selects_the_cache_and_leaves_the_model_alone() -> None:
    recipe = [{"kind": "other"}, kv_cache_step({"kind": "growing"}), kv_cache_step({"kind": "test_preallocated"})]
    assert cache_config_from_recipe(recipe) == {"kind": "test_preallocated"}
    assert cache_config_from_recipe([{"kind": "other"}]) is None
    assert cache_config_from_recipe(None) is None
    model = tiny_llama()
    assert apply_step(model, recipe[-1]) is model
    with pytest.raises(ValueError, match="unknown KV cache kind 'missing'"):
        apply_step(model, kv_cache_step({"kind": "missing"}))


def test_replaying_a_cache_that_cannot_run_here_as_measured_says_so() -> None:
    from opus.kv.static import cache_config

    model = tiny_llama()  # head size 8: the bf16 attention op takes multiples of 32
    bf16 = cache_config(attention="blocked_bf16")
    with pytest.warns(RuntimeWarning, match=r"the run's KV cache \(static, compiled decode, blocked attention in "
                                            r"bf16\) does not run here as it was measured: the bf16 attention op "
                                            r"takes a head size that is a multiple of 32, not 8"):
        assert apply_step(model, kv_cache_step(bf16)) is model
    by_batch = kvcache.by_batch_config([(1, cache_config(attention="blocked")), (None, bf16)])
    with pytest.warns(RuntimeWarning, match="above: the bf16 attention op takes a head size"):
        apply_step(model, kv_cache_step(by_batch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cache that runs as measured replays silently
        apply_step(model, kv_cache_step(by_batch["rules"][0]["cache"]))
        apply_step(model, kv_cache_step({"kind": "growing"}))
