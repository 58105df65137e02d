"""Loading a run or an export made by someone else: nothing named in its files is imported or called, and
nothing outside the directory is read, unless the caller trusts it (opus.trust)."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import textwrap
from pathlib import Path

import pytest

import opus
from opus.atomic import sha256_file
from opus.cli.main import main
from opus.errors import InputError
from opus.export.native import EXPORT_FILE, load_exported
from opus.runtime.server_process import free_port
from opus.trust import UntrustedCode

K3 = Path(__file__).resolve().parent.parent / "examples" / "k3" / "model"
# What a hostile module does the moment it is imported: leave a mark where the test can see it.
EVIL = textwrap.dedent("""
    import os, pathlib
    pathlib.Path(os.environ["OPUS_TEST_MARK"]).write_text("imported")

    def make(**_):
        pathlib.Path(os.environ["OPUS_TEST_MARK"]).write_text("called")
""")


@pytest.fixture(scope="module")
def k3_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from opus.export.native import export_model
    from opus.models import load_model
    from tests.export.test_portable import _settings

    model, tokenizer = load_model({"hf": str(K3)})
    out = tmp_path_factory.mktemp("made") / "export"
    export_model(model, tokenizer, {"recipe": []}, out, _settings({"hf": str(K3)}, out.parent))
    return out


@pytest.fixture
def mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "mark"
    monkeypatch.setenv("OPUS_TEST_MARK", str(path))
    yield path
    for name in ("evil_mod", "evil_kind"):
        sys.modules.pop(name, None)


def _edit(export_dir: Path, change) -> None:
    record = json.loads((export_dir / EXPORT_FILE).read_text())
    change(record)
    (export_dir / EXPORT_FILE).write_text(json.dumps(record))


def _hostile(k3_export: Path, tmp_path: Path, change=None) -> Path:
    """A copy of a real export with evil_mod.py beside it and its record changed by ``change``."""
    export_dir = shutil.copytree(k3_export, tmp_path / "downloaded")
    (export_dir / "evil_mod.py").write_text(EVIL)
    if change:
        _edit(export_dir, change)
    return export_dir


def _factory_export(tmp_path: Path) -> Path:
    export_dir = tmp_path / "downloaded"
    export_dir.mkdir()
    (export_dir / "evil_mod.py").write_text(EVIL)
    (export_dir / EXPORT_FILE).write_text(json.dumps({
        "format": "opus-export", "source": {"factory": "evil_mod:make"}, "base_dir": ".", "dtype": "float32",
        "device": "cpu", "state": {"recipe": [], "tensors": None}, "files": {}}))
    return export_dir


def test_a_factory_named_in_an_export_is_never_called(tmp_path: Path, mark: Path, capsys, monkeypatch) -> None:
    export_dir = _factory_export(tmp_path)
    with pytest.raises(UntrustedCode, match=r"factory is the function 'evil_mod:make': loading it would run that "
                                            r"code; pass trust_code=True"):
        opus.load(export_dir)
    assert main(["serve", str(export_dir), "--port", str(free_port())]) == 2  # refused before loading anything
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {export_dir}: the model source's factory") and "\n" not in err
    # Trusted, it is still imported from installed code only: not from the directory, even when the
    # directory is on the import path (`python -c` run inside it puts the working directory there).
    with pytest.raises(UntrustedCode, match="no installed module 'evil_mod'"):
        opus.load(export_dir, trust_code=True)
    monkeypatch.chdir(export_dir)
    monkeypatch.syspath_prepend(str(export_dir))
    with pytest.raises(UntrustedCode, match="would come from the loaded directory itself"):
        opus.load(export_dir, trust_code=True)
    assert not mark.exists() and "evil_mod" not in sys.modules


def test_a_provider_module_named_in_an_export_is_imported_only_when_trusted_and_installed(
        k3_export: Path, tmp_path: Path, mark: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def name_provider(module: str):
        return lambda r: r["state"]["recipe"].append(
            {"kind": "kv_cache", "cache": {"kind": "evil", "provider": module}})

    export_dir = _hostile(k3_export, tmp_path, name_provider("evil_mod"))
    with pytest.raises(UntrustedCode, match="the provider of the KV cache kind 'evil' names the module 'evil_mod', "
                                            "which is not Opus's own"):
        load_exported(export_dir)
    with pytest.raises(UntrustedCode, match="no installed module 'evil_mod'"):
        load_exported(export_dir, trust_code=True)
    assert not mark.exists() and "evil_mod" not in sys.modules

    # An installed third-party kind, and the caller vouches for it: it loads.
    site = tmp_path / "site"
    site.mkdir()
    (site / "evil_kind.py").write_text(EVIL + textwrap.dedent("""
        from opus.kv.cache import GrowingKVCache, register_cache

        @register_cache("evil")
        def build(options, shape):
            return GrowingKVCache(shape.num_layers)
    """))
    monkeypatch.syspath_prepend(str(site))
    _edit(export_dir, lambda r: r["state"]["recipe"][-1]["cache"].update(provider="evil_kind"))
    with pytest.raises(UntrustedCode, match="names the module 'evil_kind'"):
        load_exported(export_dir)
    assert not mark.exists()
    assert load_exported(export_dir, trust_code=True).model is not None
    assert mark.read_text() == "imported"


@pytest.mark.parametrize(("change", "says"), [
    (lambda r: r["files"].update({"../outside.txt": "0" * 64}), "'../outside.txt' is not a file name inside"),
    (lambda r: r["files"].update({"/etc/hostname": "0" * 64}), "'/etc/hostname' is not a file name inside"),
    (lambda r: r["state"].update(tensors="../outside.safetensors"), "state.tensors: '../outside.safetensors' is not"),
    (lambda r: r["model_files"].update(config="/etc/hostname"), "model_files.config: '/etc/hostname' is not"),
    (lambda r: r.update(files="all of them"), "opus-export.json lists no files"),
    (lambda r: r.update(state=[]), "damaged export record: no valid 'state'"),
    (lambda r: r.update(device="quantum:7"), "device: "),
])
def test_a_record_naming_files_outside_the_export_is_refused(k3_export: Path, tmp_path: Path, change,
                                                             says: str) -> None:
    (tmp_path / "outside.txt").write_text("secret")
    export_dir = _hostile(k3_export, tmp_path, change)
    with pytest.raises(InputError, match=says) as caught:
        load_exported(export_dir)
    assert "\n" not in str(caught.value)


def test_a_symlink_out_of_the_export_is_refused(k3_export: Path, tmp_path: Path) -> None:
    export_dir = _hostile(k3_export, tmp_path)
    outside = shutil.copyfile(export_dir / "tensors.safetensors", tmp_path / "elsewhere.safetensors")
    (export_dir / "tensors.safetensors").unlink()
    (export_dir / "tensors.safetensors").symlink_to(outside)  # same bytes, same sha256: only the place differs
    with pytest.raises(InputError, match=r"tensors.safetensors leads out of the directory \(a symlink to "):
        load_exported(export_dir)


def test_a_huge_or_special_record_is_not_read(k3_export: Path, tmp_path: Path) -> None:
    export_dir = _hostile(k3_export, tmp_path)
    with open(export_dir / EXPORT_FILE, "r+b") as record:
        record.truncate(65 * 1024 * 1024)  # sparse: takes no disk, and read whole would take 65 MB of memory
    with pytest.raises(InputError, match=r"not a readable export record: 68157440 bytes, more than the"):
        opus.load(export_dir)
    (export_dir / EXPORT_FILE).unlink()
    import os

    os.mkfifo(export_dir / EXPORT_FILE)  # a read would block until someone writes
    with pytest.raises(InputError, match=r"not a readable export record: not a regular file: a FIFO"):
        load_exported(export_dir)


def test_a_tensor_file_whose_header_claims_more_than_it_holds(k3_export: Path, tmp_path: Path) -> None:
    export_dir = _hostile(k3_export, tmp_path)
    tensors = export_dir / "tensors.safetensors"
    header = json.dumps({"x": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 4 << 30]}}).encode()
    tensors.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    _edit(export_dir, lambda r: r["files"].update({"tensors.safetensors": sha256_file(tensors)}))  # a matching sum
    with pytest.raises(InputError, match=r"tensors.safetensors: not a complete safetensors file") as caught:
        load_exported(export_dir)
    assert "\n" not in str(caught.value)
