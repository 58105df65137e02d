"""The ``onnx`` export target (opus.export.onnx_kv): a KV-cache graph that a plain onnxruntime loop generates with.

Tiny decoders built from configs (tests/fusion/fusion_kit.py): float32, W8A8, fused (qkv, gate/up,
grouped MoE), bf16 and W4A16; the README's generation loop run as written; left padding through
``attention_mask``; models it cannot export reported, not raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from opus.export.onnx_check import OrtDecoder
from opus.export.onnx_kv import ERROR_FILE, META_FILE, export_onnx
from opus.export.settings import ExportSettings
from opus.models.decoder import Attention, RotaryEmbedding

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "fusion"), str(TESTS / "models")]  # fusion_kit, opus_model_kit
from fusion_kit import prompts, tiny_lm  # noqa: E402

# The README's loop, verbatim: numpy, onnxruntime and tokenizers only (test_readme_loop runs this text).
README_LOOP = '''\
import json, numpy as np, onnxruntime as ort, tokenizers
meta, tok = json.load(open("export/onnx/opus-onnx.json")), tokenizers.Tokenizer.from_file("export/onnx/tokenizer.json")
sess = ort.InferenceSession("export/onnx/model.onnx")
ids = np.array([tok.encode("def main():\\n").ids], np.int64)
empty = np.zeros((1, meta["num_kv_heads"], 0, meta["head_dim"]), meta["kv_dtype"])
past = {i.name: empty for i in sess.get_inputs() if i.name.startswith("past_key_values.")}
out, n = [], ids.shape[1]
for _ in range(32):
    logits, *present = sess.run(None, {"input_ids": ids, "attention_mask": np.ones((1, n), np.int64),
                                       "position_ids": np.arange(n - ids.shape[1], n)[None], **past})
    past, ids, n = dict(zip(past, present)), logits[:, -1:].argmax(-1), n + 1
    if ids[0, 0] in meta["eos_token_ids"]: break
    out.append(int(ids[0, 0]))
print(tok.decode(out))
'''


def settings(**kw: object) -> ExportSettings:
    base = dict(source={}, base_dir=Path("."), batch_size=2, input_len=8, new_tokens=3, warmup=0, repeats=1,
                greedy_tokens=4, threads=1)
    return ExportSettings(**{**base, **kw})  # type: ignore[arg-type]


def word_tokenizer() -> object:
    """A word-level tokenizer over the tiny vocabulary, with the words of the README's prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "def", "main", "():", *[f"w{i}" for i in range(4, 61)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def assert_parity(outcome: object, max_diff: float = 1e-4) -> None:
    assert outcome.exported, outcome.reason
    m = outcome.metrics
    assert m["onnx_max_abs_diff"] < max_diff, m
    assert m["onnx_next_token_agreement"] == 1.0 and m["onnx_greedy_agreement"] == 1.0, m
    assert m["onnx_ttft_ms"] > 0 and m["onnx_throughput_tok_s"] > 0 and m["onnx_file_mb"] > 0


def torch_greedy(model: nn.Module, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy without any cache: the whole sequence per token (independent of both caches)."""
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0, -n:].tolist()


@pytest.fixture(scope="module")
def float_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, object, Path, object]:
    model, tok = tiny_lm("llama"), word_tokenizer()
    out = tmp_path_factory.mktemp("float")
    return model, tok, out, export_onnx(model, tok, {"recipe": [{"kind": "fuse"}]}, out, settings())


def test_float32_graph_names_metadata_and_parity(float_export) -> None:
    model, _, out, outcome = float_export
    assert_parity(outcome, 1e-4)
    assert outcome.name == "onnx" and outcome.path == "onnx" and outcome.all_metrics()["onnx_exported"] == 1
    assert "cached greedy loop" in outcome.info["onnx_p_method"] and outcome.info["onnx_recipe"] == ["fuse"]
    session = ort.InferenceSession(str(out / "onnx" / "model.onnx"))
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert inputs["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 8]
    outputs = [o.name for o in session.get_outputs()]
    assert outputs == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    meta = json.loads((out / "onnx" / META_FILE).read_text())
    assert (meta["num_layers"], meta["num_kv_heads"], meta["head_dim"], meta["kv_dtype"]) == (2, 2, 8, "float32")
    assert meta["tokenizer"] == "tokenizer.json" and (out / "onnx" / "tokenizer.json").is_file()
    assert (out / "onnx" / "model.onnx.data").is_file() and not (out / ERROR_FILE).exists()
    # The padding mask reaches attention as an additive float mask: no NaN guard over every score tensor
    # (a bool mask's translation), and left-padded rows stay finite (test_left_padding... checks them).
    graph = onnx.load(str(out / "onnx" / "model.onnx"), load_external_data=False).graph
    assert not [n.name for n in graph.node if n.op_type == "IsNaN"]
    # The export's per-row RoPE and padded attention were swapped back out of the model.
    assert type(model.model.rotary_emb) is RotaryEmbedding and type(model.model.layers[1].self_attn) is Attention


def test_readme_loop_generates_the_torch_greedy_continuation(float_export, capsys) -> None:
    model, tok, out, _ = float_export
    namespace: dict = {}
    exec(README_LOOP.replace("export/onnx/", f"{out}/onnx/"), namespace)  # noqa: S102 - the README's own text
    ids = torch.tensor([tok.encode("def main():\n").ids])
    assert ids[0, :3].tolist() == [1, 2, 3]  # real words, not [UNK]
    assert namespace["out"] == torch_greedy(model, ids, 32)
    assert capsys.readouterr().out.strip() == tok.decode(namespace["out"])


def test_readme_shows_this_loop() -> None:
    readme = (TESTS.parent / "README.md").read_text(encoding="utf-8")
    assert README_LOOP in readme and len(README_LOOP.splitlines()) <= 15


def test_left_padding_gives_each_row_its_unpadded_continuation(float_export) -> None:
    _, _, out, _ = float_export
    meta = json.loads((out / "onnx" / META_FILE).read_text())
    decoder = OrtDecoder(ort.InferenceSession(str(out / "onnx" / "model.onnx")), meta)
    long, short = prompts(1, 9, seed=3).numpy(), prompts(1, 5, seed=4).numpy()
    batch = np.concatenate([long, np.concatenate([np.zeros((1, 4), np.int64), short], axis=1)])
    mask = np.ones_like(batch)
    mask[1, :4] = 0
    tokens, logits, _ = decoder.generate(batch, 6, mask=mask)
    for row, prompt in enumerate((long, short)):
        alone, alone_logits, _ = decoder.generate(prompt, 6)
        assert tokens[row].tolist() == alone[0].tolist()
        assert max(float(np.abs(a[row] - b[0]).max()) for a, b in zip(logits, alone_logits)) < 1e-4


def test_w8a8_quantized_model(tmp_path: Path) -> None:
    from opus.quant.apply import quantize_model

    model = tiny_lm("llama", layers=1)  # one layer: the export is what takes the time
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    step = quantize_model(model, {n: "w8a8" for n in linears}, None)
    told: list[tuple] = []  # what the stage was told, in order
    outcome = export_onnx(model, None, {"recipe": [step]}, tmp_path, settings(
        progress=lambda what, done=0, total=None: told.append((what, done, total)),
        compiling=lambda active: told.append(("compiling", active))))
    assert_parity(outcome, 1e-3)
    # The two calls that say nothing until they end (torch.export, onnxruntime's graph optimization) are
    # told to the stage as compiles: the watchdog waits run.compile_timeout_s through them.
    phases = [t for t in told if t[0] == "compiling" or t[1] == 0]
    opaque = [("compiling", True), ("compiling", False)]
    assert phases == [("exporting to ONNX with a KV cache (dynamo)", 0, None), *opaque,
                      ("onnxruntime: loading and optimizing the graph", 0, None), *opaque], phases
    # Every step of the onnxruntime loops is counted to its total: the stage's progress, ETA and heartbeat.
    for what, total in (("onnxruntime parity (cached loop)", 3 * 4 * 2),  # torch, forced, free; 4 tokens, 2 prompts
                        ("onnxruntime P and D (cached loop)", 9 + 2 * 3)):  # D: 9 one-step runs; P: 2 runs × 3
        counts = [t[1:] for t in told if t[0] == what]
        assert counts == [(i, total) for i in range(1, total + 1)], what
    proto = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    graph = onnx.shape_inference.infer_shapes(proto).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input)}
    types.update({t.name: t.data_type for t in graph.initializer})
    matmuls = [n for n in graph.node if n.op_type == "MatMulInteger"]
    # uint8 x uint8 with zero points: onnxruntime's fast integer GEMMs (int8 x int8 is its slow path), and
    # exact on every CPU (uint8 x int8 can saturate without VNNI). Parity above: the same integer products.
    assert len(matmuls) == len(linears)
    for node in matmuls:
        assert [types.get(name) for name in node.input] == [onnx.TensorProto.UINT8] * 4, node.name


def test_a_tied_embedding_read_from_the_int8_head_runs_on_onnxruntime(tmp_path: Path) -> None:
    from opus.quant.apply import quantize_model
    from opus.quant.tied import share_embedding, shared_embedding_step

    model = tiny_lm("llama", layers=1)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    step = quantize_model(model, {"lm_head": "w8a8"}, None)
    share_embedding(model)
    outcome = export_onnx(model, None, {"recipe": [step, shared_embedding_step()]}, tmp_path, settings())
    assert_parity(outcome, 1e-3)
    graph = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False).graph
    int8 = [t.name for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    floats = [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2]
    vocab, hidden = model.lm_head.qweight.shape
    assert int8 and not [t.name for t in floats if list(t.dims) in ([vocab, hidden], [hidden, vocab])]  # one table


def test_fused_moe_model(tmp_path: Path) -> None:
    """Fused q/k/v, gate/up and the grouped MoE (its dense mode under export) keep parity."""
    from opus.fusion import FusionConfig, GroupedMoE, fuse_model, lm_probe

    model = fuse_model(tiny_lm("mixtral", layers=1), FusionConfig(), lm_probe(prompts()[:1, :8])).model
    assert isinstance(model.model.layers[0].mlp, GroupedMoE)
    assert isinstance(model.model.layers[0].self_attn, torch.fx.GraphModule)
    attention = model.model.layers[0].self_attn
    outcome = export_onnx(model, None, {"recipe": []}, tmp_path, settings())
    assert_parity(outcome, 1e-4)
    assert model.model.layers[0].self_attn is attention  # the padded copy was swapped back out


def test_bf16_model_runs_in_float32_on_onnxruntime(tmp_path: Path) -> None:
    model = tiny_lm("mixtral", dtype=torch.bfloat16, layers=1)
    outcome = export_onnx(model, None, {"recipe": []}, tmp_path, settings())
    assert outcome.exported, outcome.reason
    assert outcome.metrics["onnx_next_token_agreement"] == 1.0
    assert outcome.metrics["onnx_max_abs_diff"] < 0.25  # bf16 torch against a float32 graph
    assert "float32" in outcome.info["onnx_dtype"]
    proto = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    kinds = {init.data_type for init in proto.graph.initializer}
    assert onnx.TensorProto.BFLOAT16 in kinds  # weights stay bf16 on disk ...
    types = [v.type.tensor_type.elem_type for v in (*proto.graph.input[3:], *proto.graph.output)]
    assert set(types) == {onnx.TensorProto.FLOAT}  # ... the graph's values are float32
    assert json.loads((tmp_path / "onnx" / META_FILE).read_text())["kv_dtype"] == "float32"


def test_w4a16_weights_run_as_matmulnbits(tmp_path: Path) -> None:
    """The kernel's packed int4 weights, unpacked in the graph for onnxruntime's MatMulNBits: down_proj (96
    outputs: a 64-row block of the packing and a pairwise tail), gate/up (256: four blocks); the exporter
    folds the small q/k/v/o weights' unpacking into constants."""
    from opus.quant.apply import quantize_model

    model = tiny_lm("llama", layers=1, hidden_size=96, intermediate_size=256)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    step = quantize_model(model, {n: "w4a16" for n in linears}, None, group_size=32)
    outcome = export_onnx(model, None, {"recipe": [step]}, tmp_path, settings())
    assert_parity(outcome, 0.05)  # the kernel rounds to bf16; one bf16 ulp of a logit is about 0.03
    graph = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False).graph
    ops = [(n.domain, n.op_type) for n in graph.node]
    assert ops.count(("com.microsoft", "MatMulNBits")) == len(linears) and ("", "BitShift") in ops
    assert any(init.data_type == onnx.TensorProto.UINT8 for init in graph.initializer)  # packed int4 on disk


def test_sliding_window_beyond_the_window_matches_transformers(tmp_path: Path) -> None:
    """Opus's torch decoder refuses to attend past a sliding window; the graph applies the window as
    transformers does. Gemma 3 (one local layer with its own RoPE base, one global; embedding scale, q/k and
    sandwich norms): the logits match at every position, decoded one by one and prefilled, past the window."""
    from opus_model_kit import VOCAB, make_hf, save_hf

    from opus.models import load_model

    hf = make_hf("gemma3", sliding_window=6)
    model, _ = load_model({"hf": str(save_hf(hf, tmp_path / "hf"))}, ".")
    outcome = export_onnx(model, None, {}, tmp_path, settings(input_len=5, prompt_len=5, greedy_tokens=2))
    assert_parity(outcome)  # within the window, against Opus's torch decoder
    meta = json.loads((tmp_path / "onnx" / META_FILE).read_text())
    decoder = OrtDecoder(ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx")), meta)
    ids = torch.randint(0, VOCAB, (1, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(ids).logits[0].numpy()
    _, decoded, _ = decoder.generate(ids[:, :3].numpy(), 13, forced=ids[:, 3:].numpy())
    assert max(float(np.abs(got[0] - expected[2 + i]).max()) for i, got in enumerate(decoded)) < 1e-4
    _, prefilled, _ = decoder.generate(ids.numpy(), 1)
    assert float(np.abs(prefilled[0][0] - expected[-1]).max()) < 1e-4


@torch.library.custom_op("opus_test::no_onnx", mutates_args=())
def _no_onnx(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_no_onnx.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_op_without_translation_is_reported_not_raised(tmp_path: Path) -> None:
    model = tiny_lm("llama", layers=1)
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: mlp.down_proj(_no_onnx(mlp.gate_proj(x)) * mlp.up_proj(x))  # type: ignore[method-assign]
    outcome = export_onnx(model, None, {"recipe": []}, tmp_path, settings())
    assert not outcome.exported and outcome.metrics == {}
    assert outcome.reason.startswith("export: ") and "opus_test.no_onnx" in outcome.reason
    assert "\n" not in outcome.reason and ERROR_FILE in outcome.reason
    assert (tmp_path / ERROR_FILE).is_file() and not (tmp_path / "onnx").exists()


def test_not_a_decoder_is_refused(tmp_path: Path) -> None:
    outcome = export_onnx(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8)), None, {}, tmp_path, settings())
    assert not outcome.exported and "not an Opus decoder" in outcome.reason
    off = export_onnx(tiny_lm("llama"), None, {}, tmp_path, settings(onnx=False))
    assert not off.exported and "disabled" in off.reason


@pytest.mark.parametrize("rows", [16, 80, 96, 256])
def test_the_int4_kernel_layout_is_read_as_this_cpu_packs_it(rows: int) -> None:
    """torch's CPU int4 packing blocks rows by four float vectors: 64 with AVX-512, 32 with AVX2."""
    from opus.export.onnx_ops import _unpack_rows, kernel_block_rows

    nibbles = torch.randint(0, 16, (rows, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(rows))
    packed = torch._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    assert kernel_block_rows() in (64, 32, 16)
    assert torch.equal(_unpack_rows(packed, kernel_block_rows()).to(torch.int32), nibbles)
