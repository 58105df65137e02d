"""The export directory, its native part, and the targets that write beside it.

``export_model`` writes (built beside ``final``, swapped in whole)::

    opus-export.json      source (paths relative to this directory), dtype, recipe, aliases, sha256 of every
                          file, metrics, and per target whether it was exported, why not, where
    tensors.safetensors   the full state dict (shared storages once), so the base weights may change
    config.json, tokenizer.json, ...  the model's config and tokenizer (``write_model_files``): with the
                          tensors, all ``load_exported`` needs; the directory loads wherever it is moved
    hf/                   Hugging Face + compressed-tensors (``opus.export.hf_compressed``)
    gguf/model.gguf       the plan's per-tensor GGUF types (``opus.export.gguf_mix``)
    onnx/                 a KV-cache decoder graph for onnxruntime (``opus.export.onnx_kv``)

A target that cannot represent the model reports why (``opus.export.targets.TargetOutcome``); the
others are still written. What every target is given and shares is in ``opus.export.settings``; the
no-cache ONNX graph ``opus bench``'s onnxruntime contenders time is ``opus.export.onnx_graph``.
"""

from __future__ import annotations

import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opus.atomic import (
    first_mismatch,
    member_problem,
    new_temp_dir,
    read_json,
    relative_path,
    sha256_file,
    write_json,
    write_text,
)
from opus.atomic import replace_dir as swap_in
from opus.errors import InputError
from opus.export.settings import ExportSettings, one_line
from opus.export.targets import TargetOutcome
from opus.models.saved_state import Materialized, apply_state, changed_tensors
from opus.recipe import stored_recipe
from opus.trust import loading

EXPORT_FILE = "opus-export.json"
ONNX_FILE = "model.onnx"
TENSORS_FILE = "tensors.safetensors"
# What write_model_files copies from an hf source: what rebuilds the model and its tokenizer (small files).
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
               "chat_template.jinja", "chat_template.json")
FORMAT_VERSION = 1


def _relative_source(source: dict[str, Any], base_dir: Path, export_dir: Path) -> dict[str, Any]:
    """The model source with its path relative to the export directory (where it was when exported)."""
    out = dict(source)
    for key in ("hf", "gguf"):
        if key in out:
            out[key] = relative_path(Path(base_dir) / Path(out[key]).expanduser(), export_dir)
    return out


def write_model_files(model: nn.Module, tokenizer: Any, out: Path, s: ExportSettings) -> dict[str, Any]:
    """Put in ``out`` what rebuilds the model without its source: config.json, generation_config.json and
    the tokenizer files (copied from an hf source; from a GGUF's metadata, written by transformers).

    Returns the record's ``model_files``: ``config`` (the file ``load_exported`` builds the model from,
    or None) and ``files``; without a config, ``note`` says why and the export loads through its source.
    """
    from opus.models.config import ModelConfig, hf_config

    copied: list[str] = []
    if "hf" in s.source:
        source_dir = Path(s.base_dir) / Path(s.source["hf"]).expanduser()
        for name in MODEL_FILES:
            if (source_dir / name).is_file():
                shutil.copyfile(source_dir / name, out / name)
                copied.append(name)
        config = "config.json" if "config.json" in copied else None
        return {"config": config, "files": copied,
                **({} if config else {"note": f"the source {source_dir} has no config.json"})}
    if "gguf" in s.source:
        cfg = getattr(model, "config", None)
        raw = hf_config(cfg) if isinstance(cfg, ModelConfig) else None
        if raw is not None:
            write_json(out / "config.json", raw)
            copied.append("config.json")
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            before = {p.name for p in out.iterdir()}
            tokenizer.save_pretrained(str(out))
            copied += sorted(p.name for p in out.iterdir() if p.name not in before and p.is_file())
        note = {} if raw else {"note": "the GGUF's config has no Hugging Face config.json equivalent; the "
                                       "export loads through its source (a path relative to the export)"}
        return {"config": "config.json" if raw else None, "files": copied, **note}
    return {"config": None, "files": [], "note": "a factory model is rebuilt by its factory (module:function, "
                                                 "imported from base_dir relative to the export)"}


def _hf(*args: Any) -> TargetOutcome:
    from opus.export.hf_compressed import export_hf

    return export_hf(*args)


def _gguf(*args: Any) -> TargetOutcome:
    from opus.export.gguf_mix import export_gguf

    return export_gguf(*args)


def _onnx(*args: Any) -> TargetOutcome:
    from opus.export.onnx_kv import export_onnx as export_onnx_with_cache

    return export_onnx_with_cache(*args)


# Export targets beyond the native one, in the order they run: (settings flag, exporter). Imports
# are inside the functions so that a stage key hashes the exporters' code (opus.pipeline.code_reach).
TARGETS: tuple[tuple[str, Callable[..., TargetOutcome]], ...] = (("hf", _hf), ("gguf", _gguf), ("onnx", _onnx))


def _run_target(name: str, exporter: Callable[..., TargetOutcome], model: nn.Module, tokenizer: Any,
                state: dict[str, Any], out: Path, s: ExportSettings) -> TargetOutcome:
    s.progress(f"exporting {name}")
    try:
        return exporter(model, tokenizer, state, out, s)
    except Exception as exc:  # noqa: BLE001 - one target failing must not lose the others
        write_text(out / f"{name}_error.txt", "".join(traceback.format_exception(exc)))
        return TargetOutcome(name, False, reason=f"{one_line(exc)} (traceback in {name}_error.txt)")


def export_model(model: nn.Module, tokenizer: Any, state: dict[str, Any], final: Path,
                 s: ExportSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the export directory at ``final`` (built beside it, swapped in whole); returns metrics, info.

    ``info["targets"]``: per target (native, hf, gguf, onnx) whether it was exported, why not, where.
    """
    from safetensors.torch import save_file

    final.parent.mkdir(parents=True, exist_ok=True)
    out = new_temp_dir(final)
    try:
        s.progress("saving safetensors")
        tensors, aliases = changed_tensors(model, {})  # no base marks: every tensor, shared storage once
        save_file(tensors, str(out / TENSORS_FILE))
        native = TargetOutcome("native", True, path=".",
                               metrics={"export_tensors_mb": (out / TENSORS_FILE).stat().st_size / 2**20})
        outcomes = [native] + [_run_target(name, exporter, model, tokenizer, state, out, s)
                               for name, exporter in TARGETS if getattr(s, name)]
        metrics: dict[str, Any] = dict(native.metrics)  # the native export always happens: no native_exported
        for outcome in outcomes[1:]:
            metrics.update(outcome.all_metrics())
        info: dict[str, Any] = {"targets": {o.name: o.record() for o in outcomes}}
        model_files = write_model_files(model, tokenizer, out, s)  # before "files" hashes them
        record = {
            "format": "opus-export", "version": FORMAT_VERSION,
            # Paths relative to the export directory: nothing absolute leaves the machine.
            "source": _relative_source(s.source, s.base_dir, final), "base_dir": relative_path(s.base_dir, final),
            "model_files": model_files,
            "dtype": s.dtype, "device": s.device,
            "state": {"recipe": stored_recipe(state.get("recipe")), "tensors": TENSORS_FILE, "aliases": aliases},
            "onnx": info["targets"]["onnx"]["path"] if "onnx" in info["targets"] else None,
            "files": {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()},
            "metrics": metrics, "info": info,
        }
        write_json(out / EXPORT_FILE, record)
        swap_in(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return metrics, info


def _empty_model(export_dir: Path, dtype: str, device: str) -> tuple[nn.Module, Any]:
    """The export's model built from its own config.json, weights zero (every tensor comes from
    tensors.safetensors), and its tokenizer from its own tokenizer files (None without them)."""
    from opus.models import DecoderLM
    from opus.models.hf import load_hf_tokenizer, read_config
    from opus.models.load import resolve_dtype

    _, cfg = read_config(export_dir)
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        model = DecoderLM(cfg)
    model = model.to_empty(device=device).to(resolve_dtype(dtype))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    model.tie_weights()
    return model.eval(), load_hf_tokenizer(export_dir)


def _read_record(export_dir: Path) -> dict[str, Any]:
    """opus-export.json, checked as what a stranger may have written: one line naming it when it is not an
    Opus export, is damaged, or names a file outside the directory."""
    path = export_dir / EXPORT_FILE
    try:
        record = read_json(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"not a readable export record: {exc}", file=str(path)) from None
    if not isinstance(record, dict) or record.get("format") != "opus-export":
        raise InputError("not an Opus export", file=str(path))
    state, source = record.get("state"), record.get("source")
    if not isinstance(state, dict) or not isinstance(state.get("recipe", []), list) or not isinstance(source, dict):
        raise InputError("damaged export record: no valid 'state' or 'source'", file=str(path))
    for key in ("dtype", "device"):
        if not isinstance(record.get(key), str):
            raise InputError(f"damaged export record: no valid '{key}'", file=str(path))
    try:
        torch.device(record["device"])
    except RuntimeError as exc:
        raise InputError(f"device: {exc}", file=str(path)) from None
    if not isinstance(record.get("model_files") or {}, dict):
        raise InputError("damaged export record: 'model_files' is not a mapping", file=str(path))
    config = (record.get("model_files") or {}).get("config")
    for key, name in (("state.tensors", state.get("tensors")), ("model_files.config", config)):
        if name is not None and (problem := member_problem(export_dir, name)):
            raise InputError(f"{key}: {problem}", file=str(path))
    return record


def load_exported(export_dir: Path | str, device: str | None = None, verify: bool = True,
                  trust_code: bool = False) -> Materialized:
    """Rebuild an exported model from the export directory alone: the model from its config.json, the
    recipe re-applied, every tensor from tensors.safetensors; the tokenizer from its tokenizer files.

    An export without a config.json of its own (a factory model; one written before exports held
    their config) loads its source instead: a path relative to the export directory (or absolute).
    Code named in the record (a factory, a KV cache's provider module) runs only with ``trust_code``
    (opus.trust); every file it names must be a regular file inside the directory.
    """
    from opus.models import load_model

    export_dir = Path(export_dir)
    with loading(export_dir, trust_code):
        record = _read_record(export_dir)
        # Every file it wrote (config, tokenizer, tensors): an edited config.json would load another model.
        if verify and (problem := first_mismatch(export_dir, record.get("files") or {}, EXPORT_FILE)):
            raise InputError(f"the export is damaged ({problem})", file=str(export_dir))
        device = device or record["device"]
        config = (record.get("model_files") or {}).get("config")
        if config and (export_dir / config).is_file():
            model, tokenizer = _empty_model(export_dir, record["dtype"], device)
        else:
            # The source's path is relative to the export directory. A factory is refused without trust_code
            # (opus.trust), and never imports from base_dir: a loaded directory is never on the import path.
            loaded = load_model(record["source"], export_dir, dtype=record["dtype"], device=device)
            model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded, None)
        return apply_state(model, tokenizer, record["state"], export_dir, device)
