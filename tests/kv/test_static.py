"""The static KV cache: eager and compiled decode steps give the engine's tokens; by_batch picks per batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from opus.bench.torch_contenders import find_cxx
from opus.kv import compiled_steps
from opus.kv.cache import BY_BATCH, GrowingKVCache, by_batch_config, cache_factory, make_cache
from opus.kv.static import CompiledStaticKVCache, DecodeView, cache_config
from opus.runtime.engine import generate

sys.path.insert(0, str(Path(__file__).parents[1] / "fusion"))
sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from fusion_kit import prompts, tiny_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
needs_cxx = pytest.mark.skipif(find_cxx() is None, reason="inductor's CPU backend needs a C++ compiler; none found")


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_eager_static_decode_gives_the_growing_caches_logits(family):
    model = tiny_lm(family)
    ids = prompts(2, 10)
    want = generate(model, ids, 6, cache_factory(model), return_logits=True)
    got = generate(model, ids, 6, cache_factory(model, cache_config(compile_decode=False)), return_logits=True)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, atol=1e-5)


def test_slots_round_up_and_the_cache_refuses_what_does_not_fit():
    model = tiny_lm("llama")
    cache = cache_factory(model, cache_config(False, slot_multiple=16))(2, 17)
    assert isinstance(cache, CompiledStaticKVCache) and cache.slots == 32
    with torch.inference_mode():
        model(prompts(2, 30), cache=cache, start_pos=0)
        with pytest.raises(ValueError, match="decode at position 29, but the static KV cache holds 30"):
            model(prompts(2, 1), cache=cache, start_pos=29)
        model(prompts(2, 1), cache=cache, start_pos=30)
        model(prompts(2, 1), cache=cache, start_pos=31)
        with pytest.raises(ValueError, match="33 positions exceed the static KV cache's 32 slots"):
            model(prompts(2, 1), cache=cache, start_pos=32)
        with pytest.raises(ValueError, match="batch 1 does not match the static KV cache's 2"):
            model(prompts(1, 4), cache=cache_factory(model, cache_config(False))(2, 8), start_pos=0)


def test_decode_view_masks_the_slots_past_the_position():
    k = [torch.zeros(1, 1, 4, 2)]
    view = DecodeView(k, [k[0].clone()], torch.arange(4), torch.tensor([1]))
    assert view.mask.tolist() == [[True, True, False, False]]
    view.update(0, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert k[0][0, 0, :, 0].tolist() == [0.0, 1.0, 0.0, 0.0]  # written in place, at the position


def mixed_formats(name: str) -> str:
    """int4 experts and lm_head (inductor cannot lower torch's int4 CPU kernel itself), int8 attention."""
    return "w4a16" if ".experts." in name or name == "lm_head" else "w8a16"


@needs_cxx
@pytest.mark.parametrize("formats", [lambda _: "w8a8", mixed_formats], ids=["w8a8", "w4a16+w8a16"])
@torch.no_grad()
def test_compiled_decode_of_a_quantized_fused_moe_gives_the_eager_tokens_with_one_graph(monkeypatch, formats):
    from tiny import blocks, tiny_decoder

    from opus.fusion import FusionConfig, fuse_model, lm_probe
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats

    model = tiny_decoder("mixtral", seed=3)
    data = blocks(2, 16)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith(".gate")]
    quantize_model(model, {n: formats(n) for n in names}, collect_stats(model, data), group_size=64)
    model = fuse_model(model, FusionConfig(), lm_probe(data)).model
    ids = blocks(1, 12, seed=5)
    want = generate(model, ids, 8, cache_factory(model, cache_config(False)), return_logits=True)
    monkeypatch.setattr(compiled_steps, "NOTES", [])
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    got = generate(model, ids, 8, cache_factory(model, cache_config(True)), return_logits=True)
    assert compiled_steps.NOTES == []  # compiled, not the eager fallback
    assert counters["unique_graphs"] - before == 1  # every position ran the same graph: no recompiles
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, atol=1e-4)


@needs_cxx
def test_a_decode_step_that_cannot_compile_runs_eagerly_and_says_why(monkeypatch):
    import torch._inductor.config as inductor

    monkeypatch.setattr(compiled_steps, "NOTES", [])
    model = tiny_lm("llama", hidden_size=24, seed=7)  # a shape no earlier test compiled (no cache hit)
    ids = prompts(1, 5)
    want = generate(model, ids, 4).tokens
    with inductor.patch({"cpp.cxx": ("/nonexistent/opus-test-cxx",)}):
        got = generate(model, ids, 4, cache_factory(model, cache_config(True))).tokens
    assert torch.equal(got, want)
    assert len(compiled_steps.NOTES) == 1 and "decode step not compiled, runs eagerly" in compiled_steps.NOTES[0]


def test_options_are_checked_by_name():
    model = tiny_lm("llama")
    with pytest.raises(ValueError, match="no option slots"):
        cache_factory(model, {"kind": "static", "slots": 4})
    with pytest.raises(ValueError, match="slot_multiple must be a positive integer"):
        cache_factory(model, {"kind": "static", "slot_multiple": 0})


def test_by_batch_builds_each_batch_sizes_cache():
    config = by_batch_config([(1, cache_config(False)), (None, {"kind": "growing"})])
    assert config["kind"] == BY_BATCH
    model = tiny_lm("llama")
    cfg = model.config
    assert isinstance(make_cache(config, cfg, 1, 8), CompiledStaticKVCache)
    assert isinstance(make_cache(config, cfg, 2, 8), GrowingKVCache)
    ids = prompts(3, 7)
    assert torch.equal(generate(model, ids, 5, cache_factory(model, config)).tokens, generate(model, ids, 5).tokens)


@pytest.mark.parametrize("rules, message", [
    ([], "takes one option, rules"),
    ([{"up_to": 1, "cache": {"kind": "growing"}}], "rule 0: expected .* the last without up_to"),
    ([{"cache": {"kind": "growing"}}, {"cache": {"kind": "growing"}}], "rule 0: expected .* with up_to"),
    ([{"up_to": 1, "cache": {"kind": "nope"}}, {"cache": {"kind": "growing"}}], "unknown KV cache kind 'nope'"),
])
def test_by_batch_rules_are_checked(rules, message):
    with pytest.raises(ValueError, match=message):
        cache_factory(tiny_lm("llama"), {"kind": BY_BATCH, "rules": rules})


def test_a_cache_choice_reads_as_one_line():
    from opus.kv.cache import describe_cache

    config = by_batch_config([(1, cache_config(True)), (8, {"kind": "growing"}), (None, {"kind": "pooled"})])
    assert describe_cache(config) == "static, compiled decode up to batch 1; growing up to batch 8; pooled above"
    assert describe_cache(None) == "growing"


@needs_cxx
def test_each_model_runs_its_own_compiled_step(monkeypatch):
    """Two models of one structure: the second must not run the first one's graph or weights."""
    monkeypatch.setattr(compiled_steps, "NOTES", [])
    ids = prompts(1, 6)
    for seed in (11, 12):
        model = tiny_lm("qwen3", seed=seed)
        want = generate(model, ids, 5, return_logits=True)
        got = generate(model, ids, 5, cache_factory(model, cache_config(True)), return_logits=True)
        assert torch.allclose(got.logits, want.logits, atol=1e-4), seed
    assert compiled_steps.NOTES == []


def test_prefill_buckets_are_powers_of_two_within_the_slots():
    from opus.kv.static import MIN_PREFILL_BUCKET, prefill_bucket

    assert [prefill_bucket(t, 256) for t in (1, 16, 17, 100, 128, 129)] == [MIN_PREFILL_BUCKET, 16, 32, 128, 128, 256]
    assert prefill_bucket(200, 208) == 208  # never past the cache's slots


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_a_padded_prefill_gives_the_growing_caches_logits(family):
    model = tiny_lm(family)
    ids = prompts(2, 10)  # padded to 16: the padding must change nothing
    want = generate(model, ids, 6, cache_factory(model), return_logits=True)
    config = cache_config(compile_decode=False, slot_multiple=16, compile_prefill=True)
    cache = cache_factory(model, config)(2, 16)
    assert cache.prefills_itself
    got = generate(model, ids, 6, cache_factory(model, config), return_logits=True)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, atol=1e-5)
    with torch.inference_mode():
        model(ids, cache=cache, start_pos=0, last_only=True)
        with pytest.raises(ValueError, match="prefill from position 0, but the static KV cache holds 10"):
            model(ids, cache=cache, start_pos=0, last_only=True)


def test_the_compiled_prefill_is_a_candidate_only_when_asked_for():
    from opus.kv.cache import describe_cache
    from opus.kv.static import STATIC

    assert [describe_cache(c) for c in STATIC.candidates({})] == ["static, compiled decode"]
    both = STATIC.candidates({"include_static_prefill": True})
    assert [describe_cache(c) for c in both] == ["static, compiled decode", "static, compiled prefill and decode"]
    assert [STATIC.simplicity_of(c) for c in both] == [2, 3]  # a tie goes to the cache with less machinery


@needs_cxx
@torch.no_grad()
def test_a_compiled_prefill_keeps_sorted_experts_and_gives_the_eager_tokens(monkeypatch):
    """Fused int8 MoE: the prompt padded to its bucket, the sorted experts one opaque op in the graph."""
    from tiny import blocks, tiny_decoder

    from opus.fusion import FusionConfig, fuse_model, lm_probe
    from opus.fusion.moe import grouped_moes
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats
    from opus.quant.formats.w8a8 import int8_activations_at_every_size

    model = tiny_decoder("mixtral", seed=4)
    data = blocks(2, 16)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith(".gate")]
    quantize_model(model, dict.fromkeys(names, "w8a8"), collect_stats(model, data), group_size=64)
    model = fuse_model(model, FusionConfig(), lm_probe(data)).model
    assert {m.modes["prefill"] for _, m in grouped_moes(model)} == {"sorted"}
    ids = blocks(2, 11, seed=6)  # bucket 16
    monkeypatch.setattr(compiled_steps, "NOTES", [])
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    experts = type(grouped_moes(model)[0][1].experts)
    real, sorted_calls = experts.sorted, []

    def counted(self, *args):
        sorted_calls.append(args[0].shape[0])
        return real(self, *args)

    monkeypatch.setattr(experts, "sorted", counted)
    # Padding gives an expert more rows, and below 17 rows W8A8 runs its weight-only branch: quantize
    # activations at every size, so that both sides run the same kernels and padding alone is tested.
    with int8_activations_at_every_size():
        want = generate(model, ids, 6, cache_factory(model, cache_config(False)), return_logits=True)
        sorted_calls.clear()  # the eager reference ran them too
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            got = generate(model, ids, 6, cache_factory(model, cache_config(True, compile_prefill=True)),
                           return_logits=True)
    assert compiled_steps.NOTES == []  # compiled, not the eager fallback
    assert counters["unique_graphs"] - before == 2  # one prefill graph, one decode graph
    # The experts ran sorted inside the compiled graphs, not dense: as the C++ op where it is built
    # (opus.fusion.native_experts), else through the Python op.
    native = grouped_moes(model)[0][1].experts.native_reason(torch.zeros(1, 1)) is None
    ops = {event.name for event in profile.events()}
    assert ("opus_experts::w8a8_sorted" in ops) if native else bool(sorted_calls)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, atol=1e-4)


def test_blocked_attention_is_a_candidate_of_its_own_and_only_on_a_cpu():
    from opus.kv.cache import describe_cache
    from opus.kv.static import STATIC

    both = STATIC.candidates({"static_attention": ["sdpa", "blocked"]})
    assert [describe_cache(c) for c in both] == ["static, compiled decode",
                                                 "static, compiled decode, blocked attention"]
    assert [STATIC.simplicity_of(c) for c in both] == [2, 3]
    options = {"attention": "blocked"}
    assert STATIC.unavailable(tiny_lm("llama"), options) is None
    assert "measured on CPUs only; on meta" in STATIC.unavailable(tiny_lm("llama").to("meta"), options)
    # Its bf16 variant ranks below it, and is unavailable where it could only run as a copy of it.
    lossy = STATIC.candidates({"static_attention": ["blocked_bf16"]})
    assert [describe_cache(c) for c in lossy] == ["static, compiled decode, blocked attention in bf16"]
    assert [STATIC.simplicity_of(c) for c in lossy] == [4]
    assert STATIC.unavailable(tiny_lm("llama"), {"attention": "blocked_bf16"}) == (
        "the bf16 attention op takes a head size that is a multiple of 32, not 8")
    assert "measured on CPUs only; on meta" in STATIC.unavailable(tiny_lm("llama").to("meta"),
                                                                  {"attention": "blocked_bf16"})
    assert STATIC.unavailable(torch.nn.Linear(4, 4), {"attention": "blocked_bf16"}) == (
        "Linear is not an Opus decoder, which alone hands decode steps to the cache")
    with pytest.raises(ValueError, match="attention must be one of sdpa, blocked, blocked_bf16, got 'flash'"):
        cache_factory(tiny_lm("llama"), cache_config() | {"attention": "flash"})(1, 8)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_cxx)])
def test_blocked_attention_gives_the_growing_caches_tokens(compiled, monkeypatch):
    """A prompt longer than one causal block: the prefill runs in blocks, compiled or eagerly."""
    from opus.models import attention, native_attention

    model = tiny_lm("llama")
    ids = prompts(2, attention.CAUSAL_BLOCK + 30)
    monkeypatch.setattr(compiled_steps, "NOTES", [])
    ran: list[str] = []
    # traced (compiled) or run (eager): either way called; the C++ op where it is built, else torch's ops
    for module, name in ((attention, "causal_blocks"), (native_attention, "causal")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    want = generate(model, ids, 6, cache_factory(model), return_logits=True)
    config = cache_config(compiled, slot_multiple=128, compile_prefill=True, attention="blocked")
    got = generate(model, ids, 6, cache_factory(model, config), return_logits=True)
    assert compiled_steps.NOTES == []  # compiled where asked, not the eager fallback
    assert ran
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, atol=1e-5)


def test_a_bfloat16_cache_keeps_half_the_bytes_and_close_logits():
    model = tiny_lm("llama")
    ids = prompts(2, 20)
    narrow = cache_factory(model, cache_config(False, slot_multiple=16, kv_dtype="bfloat16"))(2, 32)
    wide = cache_factory(model, cache_config(False, slot_multiple=16))(2, 32)
    assert narrow.k[0].dtype == torch.bfloat16 and narrow.nbytes() * 2 == wide.nbytes()
    want = generate(model, ids, 6, cache_factory(model), return_logits=True)
    got = generate(model, ids, 6, cache_factory(model, cache_config(False, slot_multiple=16, kv_dtype="bfloat16")),
                   return_logits=True)
    assert torch.equal(got.logits[:, 0], want.logits[:, 0])  # the prompt attends to its keys as computed
    assert not torch.equal(got.logits, want.logits)  # decode steps read the rounded K/V
    assert torch.allclose(got.logits, want.logits, atol=5e-2)
    with torch.inference_mode():  # a prompt in two pieces: the second reads the stored K/V, widened
        model(ids[:, :12], cache=narrow, start_pos=0)
        second = model(ids[:, 12:], cache=narrow, start_pos=12)
        growing = cache_factory(model)(2, 32)
        model(ids[:, :12], cache=growing, start_pos=0)
        assert torch.allclose(second, model(ids[:, 12:], cache=growing, start_pos=12), atol=5e-2)
    with pytest.raises(ValueError, match="kv_dtype must be one of bfloat16, float16, int8"):
        cache_config(kv_dtype="int3")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_cxx)])
def test_an_int8_cache_keeps_a_quarter_of_the_bytes_and_close_logits(compiled, monkeypatch):
    """int8 K/V with a scale per token and head: decode steps read the stored values (compiled or eager,
    through the dot kernel); the prompt's own logits are exact; a prompt in pieces reads them too."""
    from opus.models import decoder

    model = tiny_lm("llama")
    ids = prompts(2, 20)
    monkeypatch.setattr(compiled_steps, "NOTES", [])
    ran: list[str] = []
    real = decoder.narrow_kv_attention  # as attend calls it for the dot kernel
    monkeypatch.setattr(decoder, "narrow_kv_attention", lambda *a: ran.append("dot") or real(*a))
    config = cache_config(compiled, slot_multiple=16, kv_dtype="int8")
    small = cache_factory(model, config)(2, 32)
    wide = cache_factory(model, cache_config(False, slot_multiple=16))(2, 32)
    assert small.k[0].dtype == torch.int8 and len(small.scales) == 2 * len(small.k)
    head_dim = small.k[0].shape[-1]
    assert small.nbytes() == wide.nbytes() * (head_dim + 4) // (4 * head_dim)  # int8 values + one fp32 scale
    want = generate(model, ids, 6, cache_factory(model), return_logits=True)
    got = generate(model, ids, 6, cache_factory(model, config), return_logits=True)
    assert compiled_steps.NOTES == []  # compiled where asked, not the eager fallback
    assert ran  # the decode steps' attention
    assert torch.equal(got.logits[:, 0], want.logits[:, 0])
    assert not torch.equal(got.logits, want.logits)
    assert torch.allclose(got.logits, want.logits, atol=5e-2)
    with torch.inference_mode():
        model(ids[:, :12], cache=small, start_pos=0)
        second = model(ids[:, 12:], cache=small, start_pos=12)
        growing = cache_factory(model)(2, 32)
        model(ids[:, :12], cache=growing, start_pos=0)
        assert torch.allclose(second, model(ids[:, 12:], cache=growing, start_pos=12), atol=0.1, rtol=0.05)


@needs_cxx
@pytest.mark.parametrize("compiled", [False, True])
def test_an_int8_cache_hands_decode_attention_its_bytes_where_the_op_serves(compiled, monkeypatch):
    """head_dim 32: the decode steps' attention reads the int8 K/V as stored (opus.models.int8_kv), never a
    widened copy, and decodes what the widened path decodes; without the op, the widened path serves."""
    from opus.models import decoder, int8_kv
    from opus.models.attention import DOT, INT8_STORED

    assert int8_kv.load() is None
    model = tiny_lm("llama", head_dim=32)
    ids = prompts(2, 20)
    monkeypatch.setattr(compiled_steps, "NOTES", [])
    config = cache_config(compiled, slot_multiple=16, kv_dtype="int8")
    cache = cache_factory(model, config)(2, 32)
    assert cache.decode_attention == INT8_STORED
    real = decoder.narrow_kv_attention
    monkeypatch.setattr(decoder, "narrow_kv_attention", lambda *a: pytest.fail("the widened path ran"))
    with torch.profiler.profile() as prof:
        got = generate(model, ids, 6, cache_factory(model, config), return_logits=True)
    assert compiled_steps.NOTES == []
    calls = sum(e.count for e in prof.key_averages() if "int8_decode" in e.key)
    assert calls == 5 * 2 if not compiled else calls >= 5 * 2  # 5 steps, 2 layers (compiling runs some again)
    monkeypatch.setattr(decoder, "narrow_kv_attention", real)
    monkeypatch.setattr(int8_kv, "_STATE", {"reason": "OPUS_NATIVE_OPS=0"})
    widened_cache = cache_factory(model, config)(2, 32)
    assert widened_cache.decode_attention == DOT
    want = generate(model, ids, 6, cache_factory(model, config), return_logits=True)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, atol=1e-4)


@needs_cxx
@torch.no_grad()
def test_compiled_steps_take_the_w8a8_weight_only_threshold_they_were_configured_with(monkeypatch):
    """``w8a8_weight_only_rows: 1``: a batch-2 decode step runs the int8 GEMM (as the eager model does
    under the same threshold), where the default step runs the weight-only kernel; the eager prefill
    before the steps keeps the default."""
    from opus.kv.cache import describe_cache
    from opus.kv.static import STATIC
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats
    from opus.quant.formats.w8a8 import Int8DynamicLinear, int8_activations_from

    model = tiny_lm("llama", hidden_size=64, intermediate_size=128, head_dim=16)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    quantize_model(model, dict.fromkeys(names, "w8a8"), collect_stats(model, prompts(4, 16)), group_size=32)
    ids = prompts(2, 10)
    monkeypatch.setattr(compiled_steps, "NOTES", [])
    with int8_activations_from(1):
        int8 = generate(model, ids, 6, return_logits=True)
    weight_only = generate(model, ids, 6, return_logits=True)
    config = cache_config(True, 16, kernels={"w8a8_weight_only_rows": 1})
    got = generate(model, ids, 6, cache_factory(model, config), return_logits=True)
    default = generate(model, ids, 6, cache_factory(model, cache_config(True, 16)), return_logits=True)
    assert compiled_steps.NOTES == []
    assert Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS == 16  # restored after every step
    steps = slice(1, None)  # the first logits come from the eager prefill, whose 2-row lm_head keeps the default
    apart = (int8.logits[:, steps] - weight_only.logits[:, steps]).abs().max()
    assert apart > 1e-3  # bf16 activations against int8 ones: the two branches are told apart
    assert (got.logits[:, steps] - int8.logits[:, steps]).abs().max() < apart / 10
    assert (default.logits[:, steps] - weight_only.logits[:, steps]).abs().max() < apart / 10
    assert torch.equal(got.logits[:, 0], weight_only.logits[:, 0])
    both = STATIC.candidates({"kernel_choices": {"w8a8_weight_only_rows": [None, 1]}})
    assert [describe_cache(c) for c in both] == ["static, compiled decode",
                                                 "static, compiled decode, W8A8 int8 GEMMs from 2 rows"]
    assert [STATIC.simplicity_of(c) for c in both] == [2, 3]
    assert STATIC.unavailable(model, both[1]) is None
    assert "no W8A8 layer" in STATIC.unavailable(tiny_lm("llama"), both[1])
    with pytest.raises(ValueError, match="w8a8_weight_only_rows"):
        cache_config(True, kernels={"w8a8_weight_only_rows": -1})


@needs_cxx
@torch.no_grad()
def test_compiled_steps_run_the_packed_int8_gemm_where_configured(monkeypatch):
    """``w8a8_packed_gemm``: the compiled prefill and/or decode steps call the packed kernel named for
    their phase (oneDNN's, or FBGEMM's) and compute what ``torch._int_mm`` does; the eager paths and the
    other phase keep ``_int_mm``."""
    from torch.profiler import ProfilerActivity, profile

    from opus.kv.cache import describe_cache
    from opus.kv.static import STATIC
    from opus.quant import packed
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats
    from opus.quant.fbgemm import FBGEMM
    from opus.quant.onednn import ONEDNN

    for kernel in (ONEDNN, FBGEMM):
        if kernel.available() is not None:
            pytest.skip(kernel.available())
    model = tiny_lm("llama", hidden_size=64, intermediate_size=128, head_dim=16)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    quantize_model(model, dict.fromkeys(names, "w8a8"), collect_stats(model, prompts(4, 16)), group_size=32)
    ids = prompts(2, 20)
    monkeypatch.setattr(compiled_steps, "NOTES", [])

    def run(where):  # noqa: ANN001, ANN202 - a w8a8_packed_gemm value or None
        config = cache_config(True, 16, compile_prefill=True,
                              kernels={"w8a8_weight_only_rows": 0, "w8a8_packed_gemm": where})
        generate(model, ids, 4, cache_factory(model, config))  # traced here
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = generate(model, ids, 4, cache_factory(model, config), return_logits=True)
        calls = {kernel: sum(e.count for e in prof.key_averages() if f"{kernel}_int8_linear" in e.key)
                 for kernel in ("onednn", "fbgemm")}
        return out.logits, calls

    plain, plain_calls = run(None)
    prefill, prefill_calls = run("prefill")
    both, both_calls = run("both")
    mixed, mixed_calls = run({"prefill": "onednn", "decode": "fbgemm"})
    assert compiled_steps.NOTES == []
    assert packed.active() is None  # restored after every step
    layers = sum(1 for n in names if n != "lm_head") + 1
    assert plain_calls == {"onednn": 0, "fbgemm": 0}
    assert prefill_calls == {"onednn": layers, "fbgemm": 0}  # one prefill: every W8A8 layer once
    assert both_calls == {"onednn": layers * 4, "fbgemm": 0}  # and each of the three decode steps
    assert mixed_calls == {"onednn": layers, "fbgemm": layers * 3}
    for logits in (prefill, both, mixed):
        torch.testing.assert_close(logits, plain, rtol=1e-3, atol=1e-3)
    options = {"include_static_prefill": True,
               "kernel_choices": {"w8a8_packed_gemm": [None, "decode", "prefill", {"decode": "fbgemm"}]}}
    configs = STATIC.candidates(options)
    assert [describe_cache(c) for c in configs] == [
        "static, compiled decode", "static, compiled prefill and decode",
        "static, compiled decode, packed oneDNN int8 GEMMs at decode",
        "static, compiled prefill and decode, packed oneDNN int8 GEMMs at decode",
        "static, compiled prefill and decode, packed oneDNN int8 GEMMs at prefill",  # no eager prefill packed
        "static, compiled decode, packed int8 GEMMs: FBGEMM at decode",
        "static, compiled prefill and decode, packed int8 GEMMs: FBGEMM at decode"]
    assert STATIC.unavailable(model, configs[-1]) is None
    assert "no W8A8 layer" in STATIC.unavailable(tiny_lm("llama"), configs[-1])
    for wrong in ("sometimes", {"decode": "mkl"}, {"warmup": "fbgemm"}, {}):
        with pytest.raises(ValueError, match="w8a8_packed_gemm must be one of prefill, decode, both, or a kernel"):
            cache_config(True, kernels={"w8a8_packed_gemm": wrong})


@needs_cxx
@torch.no_grad()
def test_a_compiled_prefill_computes_rope_once_and_a_compiled_step_keeps_it_inline():
    """inductor would recompute RoPE's cos/sin for every head of every layer of a compiled prompt; there they
    come from one opaque op (opus::rope_cos_sin) per forward, and a decode step keeps the inline ops."""
    from opus.models.decoder import _cos_sin, rope_cos_sin

    # Per-row positions, as the server's steps give them; then positions past the op's table (it grows), a
    # row that starts late, none, and a base it has not seen: the table's rows are the values computed directly.
    for positions, theta in ((torch.arange(12).view(2, 6), 1e4), (torch.tensor([[3, 700, 5]]), 1e4),
                             (torch.arange(7).view(1, 7) + 100, 1e4), (torch.zeros(2, 0, dtype=torch.long), 1e4),
                             (torch.arange(12).view(2, 6), 5e5)):
        got, want = rope_cos_sin(positions, 8, theta), _cos_sin(positions, 8, theta)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (positions, theta)
    model = tiny_lm("llama")
    ids = prompts(2, 10)
    config = cache_config(True, slot_multiple=16, compile_prefill=True)
    want = generate(model, ids, 4, cache_factory(model), return_logits=True)
    generate(model, ids, 4, cache_factory(model, config))  # compiles the prefill and the step
    with torch.profiler.profile() as profile:
        got = generate(model, ids, 4, cache_factory(model, config), return_logits=True)
    assert [e.name for e in profile.events()].count("opus::rope_cos_sin") == 1  # the prompt's; none per step
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, atol=1e-5)
