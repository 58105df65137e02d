"""Load failures are one-line ModelLoadErrors that name what is wrong; factory and fingerprint paths."""

from __future__ import annotations

import json

import pytest
import torch
from opus_model_kit import make_hf, save_hf
from safetensors.torch import load_file, save_file

from opus.errors import OpusError
from opus.models import ModelLoadError, load_model


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, OpusError)
    return msg


@pytest.fixture
def llama_dir(tmp_path):
    return save_hf(make_hf("llama"), tmp_path / "llama")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_type_lists_supported(llama_dir):
    _edit_config(llama_dir, model_type="gpt2")
    with pytest.raises(ModelLoadError) as err:
        load_model({"hf": str(llama_dir)})
    msg = _one_line(err)
    assert "'gpt2'" in msg and "llama" in msg and "mixtral" in msg and "qwen3_moe" in msg


def test_unsupported_rope_scaling(llama_dir):
    _edit_config(llama_dir, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0})
    with pytest.raises(ModelLoadError, match="rope type 'llama3' is not supported"):
        load_model({"hf": str(llama_dir)})


def test_missing_directory_and_files(tmp_path, llama_dir):
    with pytest.raises(ModelLoadError, match="model directory not found: .*nowhere"):
        load_model({"hf": "nowhere"}, base_dir=tmp_path)
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file: .*model\.safetensors"):
        load_model({"hf": str(llama_dir)})
    (llama_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file: .*config\.json"):
        load_model({"hf": str(llama_dir)})
    with pytest.raises(ModelLoadError, match=r"missing file: .*absent\.gguf"):
        load_model({"gguf": "absent.gguf"}, base_dir=tmp_path)


def test_shape_mismatch_names_tensor_and_both_shapes(llama_dir):
    _edit_config(llama_dir, intermediate_size=80)
    with pytest.raises(ModelLoadError) as err:
        load_model({"hf": str(llama_dir)})
    msg = _one_line(err)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "(96, 64)" in msg and "(80, 64)" in msg


def test_missing_and_unexpected_tensors(llama_dir):
    path = str(llama_dir / "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.self_attn.k_proj.weight"]
    state["model.layers.1.self_attn.k_proj.scale"] = torch.ones(1)
    save_file(state, path)
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model({"hf": str(llama_dir)})
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(state, path)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.1\.self_attn\.k_proj\.scale"):
        load_model({"hf": str(llama_dir)})


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'; supported: llama"):
        load_model({"gguf": "x.gguf"}, base_dir=tmp_path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model({"gguf": "junk.gguf"}, base_dir=tmp_path)


def test_bad_source_and_dtype(llama_dir):
    with pytest.raises(ModelLoadError, match="exactly one of hf, gguf, factory"):
        load_model({"hf": "a", "gguf": "b"})
    with pytest.raises(ModelLoadError, match="unknown dtype 'int3'"):
        load_model({"hf": str(llama_dir)}, dtype="int3")


def test_factory_source(tmp_path):
    (tmp_path / "my_tiny_model.py").write_text(
        "import torch\n"
        "def build(width=4):\n"
        "    return torch.nn.Linear(width, 2), 'a-tokenizer'\n")
    model, tok = load_model({"factory": "my_tiny_model:build", "args": {"width": 6}}, base_dir=tmp_path)
    assert isinstance(model, torch.nn.Linear) and model.in_features == 6 and tok == "a-tokenizer"
    model, tok = load_model({"factory": "opus_model_kit:make_factory_model"}, dtype="bfloat16")
    assert tok is None and next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="cannot import module 'no_such_module_xyz'"):
        load_model({"factory": "no_such_module_xyz:f"})
    with pytest.raises(ModelLoadError, match="has no callable 'nope'"):
        load_model({"factory": "opus_model_kit:nope"})
    with pytest.raises(ModelLoadError, match="must look like 'package.module:function'"):
        load_model({"factory": "just_a_name"})
