"""Finding llama.cpp's converter (sdist, directory, nowhere), the shim's fallback rule, and — when
llama-cpp-python is installed and the converter can be found — the llama.cpp contenders end to end."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from opus.bench.core import Unavailable
from opus.bench.gguf import SCRIPT, cache_root, find_converter
from opus.bench.gguf_shim import byte_level_gpt2
from opus.cli.main import main
from tests.bench.project import kv_only_run, make_project


def _sdist(path: Path) -> Path:
    files = {f"llama_cpp_python-9.9/vendor/llama.cpp/{SCRIPT}": "print('converter')\n",
             "llama_cpp_python-9.9/vendor/llama.cpp/conversion/__init__.py": "",
             "llama_cpp_python-9.9/vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
             "llama_cpp_python-9.9/vendor/llama.cpp/ggml/src/big.c": "int x;\n"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def test_converter_from_an_sdist_is_unpacked_once(tmp_path) -> None:
    sdist = _sdist(tmp_path / "llama_cpp_python-9.9.tar.gz")
    script, where = find_converter(sdist, tmp_path / "cache")
    assert script.name == SCRIPT and "unpacked from" in where
    root = script.parent
    assert (root / "conversion" / "__init__.py").is_file() and (root / "gguf-py" / "gguf").is_dir()
    assert not (root / "ggml").exists()  # only the converter's files
    again, _ = find_converter(sdist, tmp_path / "cache")
    assert again == script


def test_converter_found_in_the_cache_or_not_at_all(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip"))
    monkeypatch.delenv("OPUS_LLAMA_CPP", raising=False)
    with pytest.raises(Unavailable, match="pip download llama-cpp-python"):
        find_converter(None, tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    _sdist(tmp_path / "cache" / "llama_cpp_python-9.9.tar.gz")
    script, where = find_converter(None, tmp_path / "cache")
    assert script.is_file() and "llama_cpp_python-9.9.tar.gz" in where
    with pytest.raises(Unavailable, match="no convert_hf_to_gguf.py"):
        find_converter(tmp_path / "pip", tmp_path / "cache")


def test_shim_falls_back_only_for_a_gpt2_style_byte_level_tokenizer(tmp_path) -> None:
    def write(pre: dict) -> Path:
        (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": pre}))
        return tmp_path

    assert byte_level_gpt2(write({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}))
    assert byte_level_gpt2(write({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}]}))
    assert not byte_level_gpt2(write({"type": "ByteLevel", "use_regex": False}))
    assert not byte_level_gpt2(write({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\d"}}, {"type": "ByteLevel"}]}))
    assert not byte_level_gpt2(write({"type": "WhitespaceSplit"}))


def test_llama_cpp_end_to_end(tmp_path, capsys, monkeypatch) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'opus[llama]')")
    try:
        script, _ = find_converter(None, cache_root())
    except Unavailable as exc:
        pytest.skip(str(exc))
    monkeypatch.setenv("OPUS_CACHE_DIR", str(tmp_path / "cache"))  # the test's GGUFs stay in tmp_path
    pipeline = make_project(tmp_path)
    assert main(["bench", str(pipeline), "--only", "llama", "--converter", str(script), "--format", "json",
                 "--quiet"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name in ("llama-f16", "llama-q8_0"):
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        assert any("HF tokenizer's ids" in note for note in row["notes"]), row["notes"]
        assert row["ratios"]["perplexity"] == pytest.approx(1.0, abs=0.05)
        assert row["metrics"]["agreement"] >= 0.75
    assert rows["llama-q4_0"]["status"] == "ok", rows["llama-q4_0"]["reason"]
    assert any("llama_model_quantize" in note for note in rows["llama-q4_0"]["notes"])


def test_llama_cpp_quantizes_a_gguf_uniformly(tmp_path) -> None:
    """``llama-q4_0``'s file: llama.cpp's own quantizer over a float GGUF (here Opus's float export of K3)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'opus[llama]')")
    import gguf

    from opus.bench.llamacpp import quantize_file
    from opus.export.gguf_mix import export_gguf
    from opus.export.settings import ExportSettings
    from opus.models import load_model

    k3 = Path(__file__).resolve().parents[2] / "examples" / "k3" / "model"
    model, tokenizer = load_model({"hf": str(k3)}, ".")
    outcome = export_gguf(model, tokenizer, {}, tmp_path, ExportSettings(source={"hf": str(k3)}, base_dir=Path(".")))
    assert outcome.exported, outcome.reason
    quantize_file(tmp_path / str(outcome.path), tmp_path / "q4_0.gguf", "q4_0", threads=1)
    types = {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q4_0.gguf").tensors if len(t.shape) >= 2}
    assert "Q4_0" in types and not list(tmp_path.glob("*.partial"))


def test_llama_plan_runs_the_run_s_final_model_as_gguf(tmp_path, capsys) -> None:
    """``llama-plan``: the run's final model written by opus.export.gguf_mix, measured in llama.cpp (a run
    with no quantize stage here: every matrix F32, so llama.cpp must match the fp32 baseline)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'opus[llama]')")
    pipeline = make_project(tmp_path)
    run = kv_only_run(pipeline, tmp_path / "runs" / "tinybench-1")
    assert main(["bench", str(run), "--only", "llama-plan", "--format", "json", "--quiet"]) == 0
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}["llama-plan"]
    assert row["status"] == "ok", row["reason"]
    assert "opus.export.gguf_mix: F32 100% of the weights" in row["notes"][0]
    assert any("HF tokenizer's ids" in note for note in row["notes"]), row["notes"]
    assert row["ratios"]["perplexity"] == pytest.approx(1.0, abs=0.01)
    assert row["metrics"]["agreement"] >= 0.75
