"""The memory-bandwidth bound of batch-1 decode: the bytes a token reads, and a row's share of the bound."""

from __future__ import annotations

import pytest

from opus.bench.bandwidth import MB, bound_figures, copy_bandwidth_gb_s, read_fraction
from opus.models import DecoderLM
from opus.models.config import ModelConfig


def _model(**overrides) -> DecoderLM:
    cfg = ModelConfig(**{"family": "mixtral", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
                         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 4,
                         "max_position_embeddings": 64, "num_experts": 4, "top_k": 1,
                         "moe_intermediate_size": 24, "moe_layers": [True, True], **overrides})
    return DecoderLM(cfg)


def _bytes(model: DecoderLM, match) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if match(n))


def test_a_token_reads_top_k_of_the_experts_and_one_row_of_an_untied_embedding() -> None:
    model = _model(tie_word_embeddings=False)
    total = _bytes(model, lambda n: True)
    experts = _bytes(model, lambda n: ".experts." in n)
    embedding = _bytes(model, lambda n: "embed_tokens" in n)
    assert experts > 0 and embedding > 0
    assert read_fraction(model) == pytest.approx((total - experts * 3 / 4 - embedding) / total)
    tied = _model(tie_word_embeddings=True, top_k=4)  # every expert, and the table is the head: all of it
    assert read_fraction(tied) == pytest.approx(1.0)


def test_a_rows_share_of_the_bound() -> None:
    figures = bound_figures({"model_mb": 100.0, "decode_tok_s": 150.0}, bandwidth_gb_s=30.0, fraction=0.5)
    assert figures["bytes_per_token_mb"] == 50.0
    assert figures["bound_tok_s"] == pytest.approx(30e9 / (50 * MB))
    assert figures["decode_bound_share"] == pytest.approx(150.0 / figures["bound_tok_s"])
    assert bound_figures({"decode_tok_s": 3.0}, 30.0, 1.0) == {}  # no size, no bound
    assert "decode_bound_share" not in bound_figures({"model_mb": 10.0}, 30.0, 1.0)


def test_copy_bandwidth_is_measured() -> None:
    assert copy_bandwidth_gb_s(size_mb=16, repeats=2) > 0.1
