"""The registry's one interface: every kind builds, sizes and describes itself; the decoder needs no hasattr;
the CUDA-graph kind runs uncaptured on CPU and computes what the growing cache computes."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import opus.kv
from opus.kv import cuda_graph
from opus.kv.cache import (
    BY_BATCH,
    CacheBase,
    GrowingKVCache,
    KVCache,
    by_batch_config,
    cache_factory,
    describe_cache,
    kind_of,
    make_cache,
    registered_kinds,
)
from opus.kv.pool import default_pool
from opus.kv.sizing import kv_bytes_per_token
from opus.models import DecoderLM, ModelConfig, decoder
from opus.pipeline.code_reach import stage_reach
from opus.runtime.engine import generate

CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
SETTINGS = {"prealloc": [4], "step": [8], "max_context": 64, "static_slot_multiple": 16, "cuda_graph": True,
            "device": "cpu"}
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny_llama() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(CFG).eval()


def every_config() -> list[dict]:
    """A config of every registered kind: its own candidates, and a by_batch one over two of them."""
    configs = [c for kind in registered_kinds() for c in kind.candidates(SETTINGS)]
    return [*configs, by_batch_config([(1, {"kind": "growing"}), (None, configs[0])])]


def test_opus_kinds_are_registered_with_the_whole_interface() -> None:
    names = [k.name for k in registered_kinds()]
    assert {"growing", "pooled", "static", "cuda_graph", BY_BATCH} <= set(names)
    for kind in registered_kinds():
        assert callable(kind.build) and callable(kind.max_batch) and callable(kind.describe)
        assert isinstance(kind.simplicity, int)
    kinds = {k.name: k for k in registered_kinds()}
    # Ties go to the simpler kind: the order the README gives.
    assert [kinds[n].simplicity for n in ("growing", "pooled", "static", "cuda_graph")] == sorted(
        kinds[n].simplicity for n in ("growing", "pooled", "static", "cuda_graph"))


@pytest.mark.parametrize("config", every_config(), ids=lambda c: c["kind"])
def test_every_kind_builds_fits_its_memory_and_describes_itself(config: dict) -> None:
    """Build at batch 2 for a full context; the bytes it holds per sequence bound what max_batch promises."""
    batch, context = 2, 24
    default_pool().clear()  # blocks an earlier test freed would size this cache by that test's request
    options = {k: v for k, v in config.items() if k not in ("kind", "provider")}
    kind = kind_of(config["kind"], config.get("provider"))
    cache = make_cache(config, CFG, batch, context)
    assert isinstance(cache, KVCache)
    k = torch.randn(batch, CFG.num_kv_heads, context, CFG.head_dim)
    for layer in range(CFG.num_layers):
        cache.update(layer, k, k)
    assert cache.seq_len == context
    per_sequence = cache.nbytes() / batch
    per_token = kv_bytes_per_token(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float32)
    assert per_sequence >= per_token * context  # it holds the context
    budget = int(per_sequence * 10)
    fits = kind.max_batch(budget, per_token, context, options)
    assert 1 <= fits <= 10  # never promises more sequences than their caches' bytes allow
    line = describe_cache(config)
    assert isinstance(line, str) and line and "\n" not in line


def test_unknown_options_and_caches_without_hooks_fail_by_name() -> None:
    with pytest.raises(ValueError, match="no option"):
        make_cache(cuda_graph.cache_config() | {"compile": True}, CFG, 1, 8)

    class Bare:  # the three methods of old, none of the hooks
        def update(self, layer, k, v):
            return k, v

        seq_len, reset = 0, None

    from opus.kv.cache import register_cache

    register_cache("test_bare")(lambda options, shape: Bare())
    with pytest.raises(TypeError, match="CacheBase"):
        make_cache({"kind": "test_bare"}, CFG, 1, 8)


def test_decoder_reads_the_hooks_without_probing() -> None:
    source = inspect.getsource(decoder)
    calls = [n.func.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "hasattr" not in calls
    assert not [c for c in ast.walk(ast.parse(source)) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                and c.func.id == "getattr" and "cache" in ast.unparse(c)]
    assert GrowingKVCache().decodes_itself is False and CacheBase.mask is None and CacheBase.positions is None
    assert GrowingKVCache().stored_scales(0) is None  # attention gets float K/V unless a cache says otherwise


def test_cuda_graph_kind_runs_uncaptured_on_cpu_and_matches_the_growing_cache() -> None:
    model = tiny_llama()
    prompts = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    expected = generate(model, prompts, 6).tokens
    built = []
    factory = cache_factory(model, cuda_graph.cache_config(capture=True, slot_multiple=16))

    def tracking(batch: int, length: int):
        built.append(factory(batch, length))
        return built[-1]

    assert torch.equal(generate(model, prompts, 6, tracking).tokens, expected)
    assert built[-1].decodes_itself and not built[-1].capture and not built[-1].captured  # CPU: uncaptured
    uncaptured = cache_factory(model, cuda_graph.cache_config(capture=False, slot_multiple=16))
    assert torch.equal(generate(model, prompts, 6, uncaptured).tokens, expected)


def test_cuda_graph_kind_says_why_it_cannot_run() -> None:
    kind, model = kind_of("cuda_graph"), tiny_llama()
    assert "CUDA graphs need a CUDA device" in kind.unavailable(model, {"capture": True})
    assert kind.unavailable(model, {"capture": False}) is None
    assert "not an Opus decoder" in kind.unavailable(torch.nn.Linear(2, 2), {"capture": False})
    assert kind.candidates(SETTINGS | {"cuda_graph": False}) == []
    assert kind.candidates(SETTINGS | {"cuda_graph": None})[0]["capture"] is True  # listed, then reported
    assert kind.candidates(SETTINGS | {"cuda_graph": None, "device": "cuda:0"})[0]["capture"] is True


def test_every_kv_module_is_in_the_kv_config_stage_key() -> None:
    """A kind's module is imported by opus/kv/__init__.py, so editing it re-runs kv_config (and all stages)."""
    import pkgutil

    modules = {f"opus.kv.{m.name}" for m in pkgutil.iter_modules(opus.kv.__path__)}
    assert modules <= set(stage_reach("stages.kv_config"))
