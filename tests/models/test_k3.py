"""The committed K3 demo model: a real Mixtral directory that transformers and Opus load alike."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from opus.models import load_model

K3 = Path(__file__).resolve().parents[2] / "examples" / "k3"
MODEL = K3 / "model"


@pytest.fixture(scope="module")
def opus_k3():
    return load_model({"hf": "model"}, base_dir=K3)


@pytest.fixture(scope="module")
def sample_text() -> str:
    files = sorted((K3 / "data" / "heldout").glob("*.txt"))
    assert files, "examples/k3/data/heldout is empty"
    return files[0].read_text()[:3000]


def test_k3_layout_and_size():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
    assert cfg["num_local_experts"] >= 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert sum(f.stat().st_size for f in MODEL.glob("*.safetensors")) <= 30_000_000
    for split, limit in (("heldout", 400_000), ("calib", 400_000)):
        size = sum(f.stat().st_size for f in (K3 / "data" / split).glob("*.txt"))
        assert 0 < size <= limit, split


def test_k3_transformers_parity(opus_k3, sample_text):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = opus_k3
    assert model.config.family == "mixtral" and model.config.num_experts >= 8
    hf_tok = AutoTokenizer.from_pretrained(str(MODEL))
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL)).eval()
    assert tok.encode(sample_text) == hf_tok.encode(sample_text)
    ids = hf_tok(sample_text, return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_k3_predicts_far_better_than_unigram(opus_k3, sample_text):
    metrics = json.loads((MODEL / "training_metrics.json").read_text())
    assert metrics["heldout_perplexity"] < metrics["unigram_perplexity"] / 4
    model, tok = opus_k3
    ids = torch.tensor([tok.encode(sample_text)[:257]])
    with torch.no_grad():
        nll = F.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).item()
    assert math.exp(nll) < metrics["unigram_perplexity"] / 4


def test_k3_traces_with_fx(opus_k3):
    model, _ = opus_k3
    gm = torch.fx.symbolic_trace(model, concrete_args={"cache": None, "start_pos": 0, "last_only": True})
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(gm(ids, None, 0, True), model(ids, last_only=True))
