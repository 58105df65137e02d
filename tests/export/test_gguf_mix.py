"""The GGUF export with the plan's mix: each layer in its format's GGUF type, read back by gguf-py,
Opus's own GGUF loader, transformers and (when installed) llama.cpp, with the source tokenizer's ids."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from opus.export.gguf_mix import FALLBACK, FILE, QUANTIZING, export_gguf, stored_type  # noqa: E402
from opus.export.gguf_q4k import quantize_q4_k  # noqa: E402
from opus.export.settings import ExportSettings  # noqa: E402
from opus.export.unfused import layers  # noqa: E402
from opus.models import DecoderLM, ModelConfig, load_model  # noqa: E402
from opus.models.layout import FAMILY_TABLE  # noqa: E402

gguf = pytest.importorskip("gguf")
K3 = Path(__file__).resolve().parents[2] / "examples" / "k3" / "model"
TEXTS = ["def main():\n    return 42  # x  +  1\n", "caf\u00e9 \u00fcber 1234567890", "import os\nimport sys\n"]
# The plan's types, by llama.cpp tensor kind: attention w8a8 -> Q8_0, MLP and experts w4a16 -> Q4_K
# (Mixtral's down projections have 192 inputs: Q4_K needs 256, so Q5_0), routers and lm_head fp32.
EXPECTED = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0",
            "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K",
            "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q5_0", "ffn_gate_inp": "F32",
            "attn_norm": "F32", "ffn_norm": "F32", "output_norm": "F32", "token_embd": "F32", "output": "F32"}


def _model(family: str, tie: bool | None = None) -> DecoderLM:
    moe = family == "mixtral"
    cfg = ModelConfig(family=family, vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, num_experts=4 if moe else 0, top_k=2 if moe else 0,
                      moe_intermediate_size=192 if moe else 0, tie_word_embeddings=moe if tie is None else tie,
                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    return model.eval()


def _plan(model: nn.Module) -> dict[str, str]:
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".self_attn." in name:
            plan[name] = "w8a8"
        elif isinstance(module, nn.Linear) and name.endswith(("gate_proj", "up_proj", "down_proj")):
            plan[name] = "w4a16"
    return plan  # routers and lm_head stay fp32


def _data() -> torch.Tensor:
    return torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))


def _optimized(family: str, fused: bool) -> tuple[DecoderLM, nn.Module]:
    """(the float model, the same model quantized with the plan and, if ``fused``, fused)."""
    from opus.fusion import FusionConfig, fuse_model, lm_probe
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats

    model = _model(family)
    quantized = _model(family)
    quantize_model(quantized, _plan(quantized), collect_stats(quantized, _data()), group_size=64)
    if fused:
        quantized = fuse_model(quantized, FusionConfig(patterns=["qkv", "gate_up", "moe_grouped"]),
                               lm_probe(_data())).model
    return model, quantized


def _settings() -> ExportSettings:
    return ExportSettings(source={"hf": str(K3)}, base_dir=Path("."))

def _llama(path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: object):  # noqa: ANN202 - a llama_cpp.Llama
    """llama.cpp's model on ``path``, as llama-server's --no-repack where its defaults crash here (its weight
    repacking for AMX segfaults on some Xeons: opus.bench.llamacpp.defaults_run, tried in a child process)."""
    import llama_cpp

    from opus.bench.llamacpp import defaults_run

    if not defaults_run(path):
        default = llama_cpp.llama_cpp.llama_model_default_params

        def no_repack():  # noqa: ANN202
            params = default()
            params.use_extra_bufts = False
            return params

        monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", no_repack)
    return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)



@pytest.fixture(scope="module")
def k3_tokenizer():  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(K3)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, k3_tokenizer):  # noqa: ANN001, ANN201
    """family -> (float model, optimized unfused model, outcome, export dir); fused exports on demand."""
    out = {}
    for family in ("llama", "mixtral"):
        model, optimized = _optimized(family, fused=False)
        directory = tmp_path_factory.mktemp(f"gguf-{family}")
        outcome = export_gguf(optimized, k3_tokenizer, {"recipe": []}, directory, _settings())
        assert outcome.exported, outcome.reason
        out[family] = (model, optimized, outcome, directory)
    return out


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_tensor_types_follow_the_plan(exported, family: str) -> None:  # noqa: ANN001
    _, optimized, outcome, directory = exported[family]
    assert outcome.path == FILE and outcome.metrics["gguf_file_mb"] > 0
    types = _types(directory / FILE)
    for name, kind in types.items():
        short = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
        assert kind == EXPECTED[short], f"{name}: {kind}, the plan says {EXPECTED[short]}"
    assert ("output.weight" in types) == (family == "llama")  # Mixtral's lm_head is tied to the embedding
    assert outcome.info["tensor_types"] == dict(__import__("collections").Counter(types.values()))
    assert abs(sum(outcome.info["tensor_type_mix"].values()) - 1) < 1e-3
    downs = {n for n in layers(optimized) if n.endswith("down_proj")}
    if family == "mixtral":  # every expert's down projection is named, with the reason
        assert set(outcome.layers_not_as_planned) == downs
        assert all(v.startswith("Q5_0 instead of Q4_K") and "256" in v for v in outcome.layers_not_as_planned.values())
    else:
        assert outcome.layers_not_as_planned == {}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fused_model_writes_the_same_tensors(exported, k3_tokenizer, tmp_path: Path, family: str) -> None:  # noqa: ANN001
    _, fused = _optimized(family, fused=True)
    assert any(name.endswith(("qkv_proj", "gate_up_proj")) or "experts.gate_up" in name
               for name, _ in fused.named_modules())
    outcome = export_gguf(fused, k3_tokenizer, {"recipe": []}, tmp_path, _settings())
    assert outcome.exported, outcome.reason
    unfused = {t.name: t for t in gguf.GGUFReader(str(exported[family][3] / FILE)).tensors}
    for t in gguf.GGUFReader(str(tmp_path / FILE)).tensors:
        assert t.tensor_type == unfused[t.name].tensor_type and np.array_equal(t.data, unfused[t.name].data), t.name
    assert len(unfused) == len(gguf.GGUFReader(str(tmp_path / FILE)).tensors)
    assert outcome.layers_not_as_planned == exported[family][2].layers_not_as_planned


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@torch.no_grad()
def test_loads_back_in_opus(exported, family: str) -> None:  # noqa: ANN001
    model, optimized, outcome, directory = exported[family]
    loaded, tokenizer = load_model({"gguf": str(directory / FILE)})
    assert loaded.config.family == family and tokenizer is not None
    state = loaded.state_dict()
    for name, layer in layers(optimized).items():  # every matrix: what the optimized model computes with
        err = (state[f"{name}.weight"] - layer.weight).abs().max().item()
        step = layer.weight.abs().max().item() / (127 if layer.fmt == "w8a8" else 7 if layer.fmt == "w4a16" else 1e6)
        assert err <= step, f"{name} ({layer.fmt}): {err} > {step}"
    data = _data()
    with torch.no_grad():
        ref, ours, theirs = model(data), optimized(data), loaded(data)
    plan_error = (ours - ref).abs().mean().item()  # what the plan changed, accepted by its gates
    assert (theirs - ours).abs().mean().item() < plan_error, (family, plan_error)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@torch.no_grad()
def test_loads_in_transformers_with_the_source_tokenizer(exported, k3_tokenizer, family: str) -> None:  # noqa: ANN001
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory = exported[family][3]
    path = directory / FILE
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer.encode(text) == k3_tokenizer.encode(text), text
    assert tokenizer.eos_token_id == k3_tokenizer.eos_token_id == 0
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if family == "mixtral":
        pytest.skip("transformers reads a llama-architecture GGUF with experts as a dense Llama (it has no "
                    f"Mixtral GGUF support): {type(config).__name__} without num_local_experts")
    # from_pretrained(dir, gguf_file=...) is these two calls, less its `accelerate` requirement
    hf = AutoModelForCausalLM.from_config(config).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and not config.tie_word_embeddings
    loaded, _ = load_model({"gguf": str(path)})
    ids = _data()
    assert torch.allclose(hf(ids).logits, loaded(ids), atol=1e-4)


@torch.no_grad()
def test_a_tied_lm_head_quantized_on_its_own_is_written_as_output(k3_tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    """The plan may give a tied lm_head its own int8 copy (K3's demo plan does): the file then has an
    output.weight in Q8_0 beside the F32 embedding, and loads back untied."""
    from opus.quant.apply import quantize_model

    model = _model("llama", tie=True)
    ref = model(_data())
    quantize_model(model, {"lm_head": "w8a8"}, None)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the embedding stays as it was
    counted: list[tuple] = []
    settings = _settings()
    settings.progress = lambda what, done=0, total=None: counted.append((what, done, total))
    outcome = export_gguf(model, k3_tokenizer, {}, tmp_path, settings)
    assert outcome.exported, outcome.reason
    per_layer = [(done, total) for what, done, total in counted if what == QUANTIZING]  # the stage's heartbeat
    assert per_layer == [(i, len(layers(model))) for i in range(len(layers(model)))]
    types = _types(tmp_path / FILE)
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "F32"
    loaded, _ = load_model({"gguf": str(tmp_path / FILE)})
    assert not loaded.config.tie_word_embeddings
    assert torch.allclose(loaded(_data()), ref, atol=0.05 * ref.abs().max().item())


@pytest.mark.parametrize("family", [f.name for f in FAMILY_TABLE if f.gguf_arch])
@torch.no_grad()
def test_every_family_with_a_llama_cpp_architecture_round_trips(k3_tokenizer, tmp_path: Path, family: str,  # noqa: ANN001
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A float model of each family (biases, q/k norms, shared experts, permuted q/k) comes back exactly
    through Opus's GGUF loader, and — when installed — llama.cpp computes its logits."""
    from opus.models.layout import family as family_of

    fam = family_of(family)
    moe = bool(fam.moe)
    cfg = ModelConfig(family=family, vocab_size=4096, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4 if moe else 0, top_k=2 if moe else 0,
                      moe_intermediate_size=32 if moe else 0, qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm,
                      shared_expert_intermediate_size=64 if fam.shared_expert else 0,
                      norm_topk_prob=fam.gguf_norm_topk, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    for name, p in model.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    outcome = export_gguf(model, k3_tokenizer, {}, tmp_path, _settings())
    assert outcome.exported, outcome.reason
    ids = k3_tokenizer.encode(TEXTS[0])
    want = model(torch.tensor([ids]))[0]
    loaded, _ = load_model({"gguf": str(tmp_path / FILE)})
    assert torch.equal(loaded(torch.tensor([ids]))[0], want)
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    llm = _llama(tmp_path / FILE, monkeypatch, n_ctx=64, logits_all=True)
    try:
        llm.eval(ids)
        got = torch.from_numpy(np.asarray(llm.scores[: len(ids)]))
    finally:
        llm.close()
    assert (got - want).abs().max().item() < 0.01 * want.abs().max().item()  # llama.cpp's f16 KV cache


def test_q4_k_blocks_read_back_exactly_by_gguf_py() -> None:
    """Values Q4_K represents exactly (d, dmin, 6-bit scales and minimums, 4-bit codes) come back
    exactly through gguf-py's dequantizer: the block layout is the one llama.cpp reads."""
    rng = np.random.default_rng(0)
    blocks, subs = 6, 8
    d, dmin = np.float16(0.0123), np.float16(0.0456)
    sc = rng.integers(1, 64, (blocks, subs))
    mn = rng.integers(0, 64, (blocks, subs))
    sc[:, 0], mn[:, 1] = 63, 63  # the block's largest scale and minimum set d and dmin
    q = rng.integers(0, 16, (blocks, subs, 32))
    q[..., 0], q[..., 1] = 0, 15  # each sub-block spans its 16 levels
    x = (np.float32(d) * sc[..., None] * q - np.float32(dmin) * mn[..., None]).astype(np.float32).reshape(2, -1)
    packed = quantize_q4_k(x)
    assert packed.shape == (2, x.shape[1] // 256 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K][1])
    back = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    assert np.allclose(back, x, atol=1e-6)


def test_fallback_types_go_from_least_to_most_accurate() -> None:
    w = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)
    errors = []
    for name in FALLBACK:
        qtype = gguf.GGMLQuantizationType[name]
        data = quantize_q4_k(w) if name == "Q4_K" else gguf.quants.quantize(w, qtype)
        errors.append(float(np.abs(gguf.quants.dequantize(data, qtype).reshape(w.shape) - w).mean()))
    assert errors == sorted(errors, reverse=True) and errors[-1] == 0, dict(zip(FALLBACK, errors))


def test_stored_type_moves_up_to_the_first_type_that_fits() -> None:
    w = np.ones((4, 4), np.float32)
    assert stored_type("Q4_K", 512, w) == ("Q4_K", None)
    assert stored_type("Q4_K", 192, w)[0] == "Q5_0"  # as llama-quantize falls back
    assert stored_type("Q8_0", 100, w)[0] == "F16"
    assert stored_type("Q8_0", 100, w * 1e5)[0] == "F32"
    assert stored_type(None, 64, w) == ("F16", "the format has no GGUF type: stored dequantized")
    assert stored_type("BF16", 7, w) == ("BF16", None)


def test_a_model_it_cannot_write_is_not_exported_with_the_reason(k3_tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    outcome = export_gguf(nn.Sequential(nn.Linear(4, 4)), k3_tokenizer, {}, tmp_path, _settings())
    assert not outcome.exported and "not an Opus decoder" in outcome.reason
    outcome = export_gguf(_model("llama"), None, {}, tmp_path, _settings())
    assert not outcome.exported and "tokenizer" in outcome.reason
    assert not (tmp_path / FILE).exists() and not list((tmp_path / "gguf").glob("*.tmp"))


@torch.no_grad()
def test_llama_cpp_runs_the_k3_demo_model_with_a_mixed_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """K3 with W8A8 attention and W4A16 experts (Q8_0, Q4_K and Q5_0 tensors) runs in llama.cpp: its
    tokenizer gives the HF ids, its logits pick Opus's next tokens, its greedy text is Opus's."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                    "'opus[llama]' builds llama.cpp, ~5 min); CI has no llama.cpp")
    from opus.quant.apply import quantize_model
    from opus.quant.calibrate import collect_stats

    model, tokenizer = load_model({"hf": str(K3)})
    text = (K3.parent / "train.py").read_text(encoding="utf-8")[:3000]
    calibration = torch.tensor(tokenizer.encode(text)[:512]).reshape(4, 128)
    plan = {n: "w8a8" if ".self_attn." in n else "w4a16" for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (".self_attn." in n or ".experts." in n)}
    quantize_model(model, plan, collect_stats(model.eval(), calibration), group_size=64)
    outcome = export_gguf(model, tokenizer, {"recipe": []}, tmp_path, _settings())
    assert outcome.exported, outcome.reason
    assert set(outcome.info["tensor_types"]) == {"Q8_0", "Q4_K", "Q5_0", "F32"}
    llm = _llama(tmp_path / FILE, monkeypatch, n_ctx=256, n_threads=2, logits_all=True)
    try:
        prompt = "def main():\n    import os\n"
        ids = tokenizer.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == ids
        llm.eval(ids)
        theirs = np.asarray(llm.scores[: len(ids)])
        ours = model(torch.tensor([ids]))[0].numpy()
        assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.9
        text = llm(prompt, max_tokens=24, temperature=0.0, top_k=1)["choices"][0]["text"]
    finally:
        llm.close()
    x = torch.tensor([ids])
    for _ in range(24):
        x = torch.cat([x, model(x)[:, -1:].argmax(-1)], dim=1)
    want = x[0, len(ids):].tolist()
    got = tokenizer.encode(text)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= 0.75 * len(want), (text, tokenizer.decode(want))


def test_a_sentencepiece_style_tokenizer_is_written_as_llama_vocabulary(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A BPE with byte fallback (Llama 2 / Mistral style) is tokenizer.ggml.model 'llama' with scores from
    its merge order: transformers (and llama.cpp, when installed) give the source's ids, bytes included."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    lines = (K3.parent / "train.py").read_text(encoding="utf-8").splitlines()
    backend.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=700, special_tokens=specials))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    source = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    cfg = ModelConfig(family="llama", vocab_size=768, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, bos_token_id=1, eos_token_id=2)
    outcome = export_gguf(DecoderLM(cfg).eval(), source, {}, tmp_path, _settings())
    assert outcome.exported, outcome.reason
    vocab = outcome.info["tokenizer"]
    assert (vocab["model"], vocab["padding"], vocab["roundtrip"]) == ("llama", 68, "same ids as the source tokenizer")
    texts = [*TEXTS, "caf\u00e9 \u2603"]  # the snowman is not in the vocabulary: byte fallback
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    llm = _llama(tmp_path / FILE, monkeypatch, n_ctx=64)
    try:
        for text in texts:
            assert llm.tokenize(text.encode(), add_bos=True, special=False) == source.encode(text), text
    finally:
        llm.close()
