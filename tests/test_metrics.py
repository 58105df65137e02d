"""Metrics: perplexity/top-1 against an independent computation, fidelity of a model to itself,
peak memory, and the suite's keys and progress accounting. No timing thresholds."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from opus import metrics
from opus.kvcache import cache_factory
from opus.metrics import (
    PeakMemory,
    Progress,
    Reference,
    Settings,
    compare_to_reference,
    evaluate_lm,
    fidelity_prompts,
    fidelity_units,
    make_reference,
    measure_suite,
    model_mb,
    prepare_inputs,
)
from opus.models import DecoderLM, ModelConfig
from opus.spec import WorkloadSpec

VOCAB = 71


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(family="mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, moe_intermediate_size=48)
    return DecoderLM(cfg).eval()


def blocks(n: int = 5, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def test_perplexity_and_top1_match_an_independent_computation(model) -> None:
    data = blocks()
    with torch.no_grad():
        logits = model(data)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), data[:, 1:].reshape(-1))
    top1 = (logits[:, :-1].argmax(-1) == data[:, 1:]).float().mean()
    got = evaluate_lm(model, data, batch_size=2)  # batches of 2, 2, 1: a ragged last batch
    assert got["perplexity"] == pytest.approx(math.exp(ce.item()), rel=1e-5)
    assert got["top1_accuracy"] == pytest.approx(top1.item())
    assert got["eval_tokens"] == 5 * 11


def test_a_model_agrees_with_itself(model, tmp_path) -> None:
    factory = cache_factory(model)
    ref = make_reference(model, blocks(3, 6), 5, factory)
    assert ref.tokens.shape == (3, 5) and ref.logits.shape == (3, 5, VOCAB) and ref.top5.shape == (3, 5, 5)
    loaded = Reference.load(ref.save(tmp_path / "ref.safetensors"))
    got = compare_to_reference(model, loaded, factory)
    assert got["agreement"] == 1.0 and got["agreement_free"] == 1.0 and got["top5_overlap"] == 1.0
    assert got["logits_cosine"] == pytest.approx(1.0, abs=1e-6)
    half = Reference.load(ref.save(tmp_path / "half.safetensors", max_fp32_mb=0))  # stored as fp16
    got = compare_to_reference(model, half, factory)
    assert got["agreement"] == 1.0 and got["logits_cosine"] == pytest.approx(1.0, abs=1e-4)


def test_a_perturbed_model_scores_lower(model) -> None:
    factory = cache_factory(model)
    ref = make_reference(model, blocks(4, 6, seed=1), 6, factory)
    other = copy.deepcopy(model)
    with torch.no_grad():
        weight = other.lm_head.weight
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        weight.add_(noise * weight.std() * 2)
    got = compare_to_reference(other, ref, factory)
    assert got["logits_cosine"] < 0.99
    assert got["agreement"] < 1.0 and got["top5_overlap"] < 1.0
    assert all(0.0 <= got[k] <= 1.0 for k in ("agreement", "agreement_free", "top5_overlap"))


def test_reference_logits_are_teacher_forced_on_the_greedy_continuation(model) -> None:
    prompts = blocks(2, 5, seed=2)
    ref = make_reference(model, prompts, 4, cache_factory(model))
    with torch.no_grad():
        full = model(ref.inputs)
    torch.testing.assert_close(ref.logits, full[:, 4:], atol=1e-5, rtol=1e-5)
    assert torch.equal(ref.top5[..., 0], ref.tokens)  # greedy: each token is the argmax before it


def test_peak_memory_sees_an_allocation(monkeypatch) -> None:
    for sampled in (False, True):
        if sampled:  # where the kernel refuses the high-water-mark reset, a thread samples RSS
            monkeypatch.setattr(metrics, "_reset_high_water_mark", lambda: False)
        with PeakMemory("cpu") as memory:
            held = torch.ones(16 << 20)  # 64 MiB, touched
        assert memory.method == ("rss_sampled" if sampled else "rss_high_water_mark")
        assert memory.rise_mb >= 60 and memory.peak_mb >= memory.rise_mb
        del held


def test_model_mb_counts_tied_weights_once() -> None:
    cfg = ModelConfig(family="llama", vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    tied = DecoderLM(cfg)
    params = sum(p.numel() for p in tied.parameters()) * 4  # parameters() already deduplicates
    buffers = sum(b.numel() * b.element_size() for b in tied.buffers())
    assert model_mb(tied) * (1 << 20) == params + buffers


def test_suite_reports_every_metric_and_exact_progress(model) -> None:
    workload = WorkloadSpec(batch_size=2, input_len=8, output_len=3, warmup=0, repeats=2)
    reports: list[tuple] = []
    progress = Progress(lambda done, total, what: reports.append((done, total, what)), interval_s=0)
    inputs = prepare_inputs(model, None, workload, None, None)
    inputs.eval_blocks = blocks(3, 10)
    progress.expect(fidelity_units(3))
    got, info = measure_suite(model, inputs, workload, Settings(eval_batch_size=2), cache_factory(model), progress)
    for key in ("throughput_tok_s", "prefill_ms_batch", "decode_tok_s_batch", "ttft_ms", "decode_tok_s", "peak_mem_mb",
                "perplexity", "top1_accuracy", "model_mb"):
        assert got[key] > 0, key
    assert info["prompt_source"] == "random" and info["memory_method"]
    prompts, source = fidelity_prompts(model, inputs, 2, 4)
    assert source == "text"  # the evaluation blocks (here: random ids standing in for text)
    make_reference(model, prompts, 3, cache_factory(model), progress)
    assert reports[-1][0] == reports[-1][1] == progress.total  # the ETA's total was exact
    assert [r[0] for r in reports] == sorted(r[0] for r in reports)


def test_switches_turn_measurements_off(model) -> None:
    workload = WorkloadSpec(batch_size=1, input_len=4, output_len=1, warmup=0, repeats=1)
    inputs = prepare_inputs(model, None, workload, None, None)
    settings = Settings(throughput=False, decode_batch1=False)
    got, _ = measure_suite(model, inputs, workload, settings, cache_factory(model))
    assert set(got) == {"model_mb", "ttft_ms"}  # no evaluation blocks: no perplexity


def test_prompts_come_from_text_when_it_is_long_enough(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from opus.spec import TextSetSpec

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(30)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "a.txt").write_text(" ".join(f"w{i % 30}" for i in range(200)))
    text = TextSetSpec(files=["a.txt"], samples=3, seq_len=20)
    cfg = ModelConfig(family="llama", vocab_size=31, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8)
    small = DecoderLM(cfg)
    inputs = prepare_inputs(small, tok, WorkloadSpec(batch_size=2, input_len=50), text, tmp_path)
    assert inputs.prompt_source == "text" and inputs.prompts.shape == (2, 50)
    assert inputs.eval_blocks is not None and inputs.eval_blocks.shape == (3, 20)
    assert torch.equal(fidelity_prompts(small, inputs, 2, 8)[0], inputs.eval_blocks[:2, :8])
    assert fidelity_prompts(small, inputs, 2, 30)[1] == "random"  # blocks too short
    logged: list[str] = []
    inputs = prepare_inputs(small, tok, WorkloadSpec(batch_size=8, input_len=50), text, tmp_path, logged.append)
    assert inputs.prompt_source == "random" and inputs.prompts.shape == (8, 50)
    assert "random token ids" in logged[0]
