"""GGUF files written the way llama.cpp's converter writes them load back to the source model's logits."""

from __future__ import annotations

import pytest
import torch
from opus_model_kit import FAMILY_CASES, GGUF_ARCH, VOCAB, hf_logits, make_hf, write_gguf

from opus.models import DecoderLM, load_model
from opus.models.gguf_file import permute_qk, unpermute_qk


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(unpermute_qk(permute_qk(w, 4), 4), w)
    assert not torch.equal(permute_qk(w, 4), w)


# Every family of the table (test_layout checks) that llama.cpp files under an architecture Opus reads.
@pytest.mark.parametrize("family", [f for f in FAMILY_CASES if f in GGUF_ARCH])
def test_f32_gguf_matches_source(family, tmp_path):
    overrides = {"attention_bias": True} if family == "llama" else {}  # permuted q/k biases too
    ref = make_hf(family, **overrides)
    path = write_gguf(ref, family, tmp_path / "m.gguf", "F32")
    model, tokenizer = load_model({"gguf": "m.gguf"}, base_dir=tmp_path)
    # A Mistral GGUF is filed under "llama" (as llama.cpp's converter does): it loads as a Llama.
    assert isinstance(model, DecoderLM) and model.config.family == ("llama" if family == "mistral" else family)
    ids = _ids()
    with torch.no_grad():
        diff = (model(ids) - hf_logits(ref, ids)).abs().max().item()
    assert diff < 1e-4, f"{family}: {diff}"
    assert path.stat().st_size > 0 and tokenizer is not None


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_q8_0_gguf_is_close_to_source(family, tmp_path):
    ref = make_hf(family)
    write_gguf(ref, family, tmp_path / "q8.gguf", "Q8_0")
    write_gguf(ref, family, tmp_path / "f32.gguf", "F32")
    q8, _ = load_model({"gguf": str(tmp_path / "q8.gguf")}, base_dir=".")
    f32, _ = load_model({"gguf": str(tmp_path / "f32.gguf")}, base_dir=".")
    exact = f32.state_dict()
    for name, w in q8.state_dict().items():  # every matrix quantized, none mangled
        err = (w - exact[name]).abs().max().item()
        assert err <= 0.01 * exact[name].abs().max().item(), name
        assert err > 0 or w.dim() == 1, name
    if family == "llama":  # a random router flips experts on tiny weight changes: compare logits on dense only
        ids = _ids()
        with torch.no_grad():
            got, want = q8(ids), hf_logits(ref, ids)
        assert 0 < (got - want).abs().max().item() < 0.03 * want.abs().max().item()


def test_gguf_tokenizer_roundtrip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    ref = make_hf("llama", vocab_size=tok.get_vocab_size())
    write_gguf(ref, "llama", tmp_path / "m.gguf", tokenizer=tok)
    _, loaded = load_model({"gguf": str(tmp_path / "m.gguf")}, tmp_path)
    sample = "def mul(a, b):\n    return a * b  # é<|endoftext|>"
    assert loaded.encode(sample) == tok.encode(sample).ids
    assert loaded.decode(loaded.encode(sample)) == sample
    assert loaded.eos_token == "<|endoftext|>"
