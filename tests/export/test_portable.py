"""A native export is self-contained and holds no absolute path: moved anywhere, with its source model
gone, ``load_exported`` rebuilds the same model and tokenizer from the export directory alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from opus.errors import InputError
from opus.export.native import EXPORT_FILE, export_model, load_exported
from opus.export.settings import ExportSettings
from opus.models import load_model
from opus.models.config import hf_config
from opus.pipeline.run_files import EXPORT_RECORD

K3 = Path(__file__).resolve().parents[2] / "examples" / "k3" / "model"
TEXT = "def main():\n    return os.path.join(a, b)  # 42\n"


def _settings(source: dict, base_dir: Path) -> ExportSettings:
    s = ExportSettings(source=source, base_dir=base_dir, onnx=False, batch_size=1, input_len=8, new_tokens=2,
                       warmup=0, repeats=1, greedy_tokens=2)
    for other in ("hf", "gguf"):  # the other export targets are tested on their own
        if hasattr(s, other):
            setattr(s, other, False)
    return s


def _strings(value: object) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _assert_no_absolute_path(export_dir: Path, *roots: Path) -> None:
    record = json.loads((export_dir / EXPORT_FILE).read_text())
    text = (export_dir / EXPORT_FILE).read_text()
    assert [s for s in _strings(record) if s.startswith("/")] == []
    for root in roots:
        assert str(root) not in text


def _move(export_dir: Path, tmp_path: Path, *gone: Path) -> Path:
    """The export copied elsewhere, the original and the source model out of the way."""
    moved = shutil.copytree(export_dir, tmp_path / "elsewhere" / "deep" / "shipped")
    shutil.rmtree(export_dir)
    for path in gone:
        path.rename(path.with_name(path.name + "-gone"))
    return moved


def test_record_name_is_the_run_files_one() -> None:
    assert EXPORT_RECORD == EXPORT_FILE


def test_hf_source_quantized_export_moves_and_loads_without_its_source(tmp_path: Path) -> None:
    from opus.quant.apply import quantize_model

    source = shutil.copytree(K3, tmp_path / "project" / "model")
    model, tokenizer = load_model({"hf": "model"}, base_dir=source.parent)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".self_attn." in n]
    step = quantize_model(model, {n: "w8a8" if i % 2 else "w8a16" for i, n in enumerate(linears)}, None)
    export_dir = tmp_path / "run" / "stages" / "07-export" / "artifacts" / "export"
    export_model(model, tokenizer, {"recipe": [step]}, export_dir, _settings({"hf": "model"}, source.parent))

    record = json.loads((export_dir / EXPORT_FILE).read_text())
    assert record["model_files"]["config"] == "config.json"
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(record["model_files"]["files"])
    assert (export_dir / "../../../../../project/model").resolve() == source.resolve()  # relative to the export
    assert set(record["model_files"]["files"]) <= set(record["files"])  # hashed like every file
    _assert_no_absolute_path(export_dir, tmp_path)

    moved = _move(export_dir, tmp_path, source)
    reloaded = load_exported(moved)
    assert type(reloaded.model.model.layers[0].self_attn.q_proj) is type(model.model.layers[0].self_attn.q_proj)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    assert reloaded.tokenizer(TEXT)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids), model(ids))


def test_export_written_before_it_held_its_config_still_loads(tmp_path: Path) -> None:
    """An older record: absolute source and base_dir, no model files: the model comes from its source."""
    model, tokenizer = load_model({"hf": str(K3)})
    export_dir = tmp_path / "export"
    export_model(model, tokenizer, {"recipe": []}, export_dir, _settings({"hf": str(K3)}, tmp_path))
    record = json.loads((export_dir / EXPORT_FILE).read_text())
    for name in record.pop("model_files")["files"]:
        (export_dir / name).unlink()
        del record["files"][name]  # it listed only what it wrote
    record.update(source={"hf": str(K3)}, base_dir=str(tmp_path))
    (export_dir / EXPORT_FILE).write_text(json.dumps(record))
    reloaded = load_exported(export_dir)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    assert reloaded.tokenizer is not None
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids), model(ids))


def test_an_edited_or_missing_file_is_a_damaged_export(tmp_path: Path) -> None:
    """The record's sha256 covers every file it wrote: an edited config.json (another model) or a lost
    tokenizer refuses to load, naming the file, rather than loading something the run never measured."""
    model, tokenizer = load_model({"hf": str(K3)})
    export_dir = tmp_path / "export"
    export_model(model, tokenizer, {"recipe": []}, export_dir, _settings({"hf": str(K3)}, tmp_path))
    config = export_dir / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"rope_theta": ', '"rope_theta": 1'))
    assert config.read_text() != text
    with pytest.raises(InputError, match=r"export: the export is damaged \(config.json does not match its sha256"):
        load_exported(export_dir)
    config.write_text(text)
    assert load_exported(export_dir).model.config == model.config
    (export_dir / "tokenizer.json").unlink()
    with pytest.raises(InputError, match=r"damaged \(tokenizer.json is missing\)"):
        load_exported(export_dir)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_gguf_source_export_writes_its_config_and_tokenizer(family: str, tmp_path: Path) -> None:
    from tests.models.opus_model_kit import make_hf, write_gguf

    (tmp_path / "project").mkdir()
    gguf = write_gguf(make_hf(family), family, tmp_path / "project" / "m.gguf")
    model, tokenizer = load_model({"gguf": "m.gguf"}, base_dir=gguf.parent)
    assert hf_config(model.config) is not None  # every family's GGUF config has its config.json
    export_dir = tmp_path / "export"
    export_model(model, tokenizer, {"recipe": []}, export_dir, _settings({"gguf": "m.gguf"}, gguf.parent))
    record = json.loads((export_dir / EXPORT_FILE).read_text())
    assert record["source"] == {"gguf": "../project/m.gguf"}
    assert {"config.json", "tokenizer.json"} <= set(record["model_files"]["files"])
    _assert_no_absolute_path(export_dir, tmp_path)

    moved = _move(export_dir, tmp_path, gguf)
    reloaded = load_exported(moved)
    assert reloaded.model.config == model.config
    text = "<t3><t5><t7>"
    assert reloaded.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids), model(ids))


def test_factory_source_keeps_a_relative_base_dir(tmp_path: Path) -> None:
    from tests.stages.test_export import tiny_llama

    model = tiny_llama()
    repo = Path(__file__).resolve().parents[2]
    export_dir = tmp_path / "export"
    export_model(model, None, {"recipe": []}, export_dir,
                 _settings({"factory": "tests.stages.test_export:tiny_llama"}, repo))
    record = json.loads((export_dir / EXPORT_FILE).read_text())
    assert record["model_files"]["config"] is None and "factory" in record["model_files"]["note"]
    assert (export_dir / record["base_dir"]).resolve() == repo  # recorded; loading imports installed code only
    _assert_no_absolute_path(export_dir)
    ids = torch.randint(0, 61, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_exported(export_dir, trust_code=True).model(ids), model(ids))
