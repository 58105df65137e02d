"""Preflight of the model source: its headers are read and checked, no weight is loaded.

A Hugging Face directory: config.json present, valid JSON, a supported ``model_type`` and values
that make a model (``opus.models.config.config_from_hf`` decides, as the loader would), and every
safetensors file (from the shard index when there is one) complete: ``safe_open`` maps the file and
checks that its header covers it exactly, which a truncated copy fails. A GGUF file: its header
parses, the architecture is supported, the keys the loader needs are there and transformers builds
its tokenizer (opus.models.gguf_tokenizer). For both, the weights at the pipeline's dtype must fit
in this machine's memory (and in the GPU's on CUDA).
A factory is code: it must import and name a function, and it is called once on the meta device (no
weights allocated): a transformers model of a family Opus cannot load into its decoder is refused
naming its class (opus.models.load.check_factory). Its tokenizer is known only once it runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opus.pipeline.spec import LoadedPipeline

TokenizerLoader = Callable[[], Any]  # the model's tokenizer, None or UNKNOWN; loaded only when text needs it
UNKNOWN = object()  # a factory's tokenizer: known only once the factory runs
_REQUIRED_GGUF_KEYS = ("embedding_length", "block_count", "attention.head_count", "context_length",
                       "attention.layer_norm_rms_epsilon")
_POSITIVE = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
GB = 1e9


def check_model(loaded: LoadedPipeline) -> TokenizerLoader:
    """Check the model source's files; return how to get its tokenizer for the text checks."""
    spec = loaded.spec.model
    if spec.hf:
        return _check_hf(loaded, loaded.base_dir / spec.source()["hf"])  # a hub id: its cached snapshot
    if spec.gguf:
        return _check_gguf(loaded, loaded.base_dir / spec.gguf)
    _check_factory(loaded)
    return lambda: UNKNOWN  # a factory: what it returns is known only once it runs


def _check_factory(loaded: LoadedPipeline) -> None:
    from opus.models.config import ModelLoadError
    from opus.models.load import check_factory

    try:
        cfg = check_factory(loaded.spec.model.source(), loaded.base_dir)
    except ModelLoadError as exc:
        raise loaded.error(str(exc), ("model", "factory")) from None
    if cfg is not None:
        _check_window(loaded, cfg)


def _check_window(loaded: LoadedPipeline, cfg: Any) -> None:
    """A model with a sliding window (Mistral) runs only contexts within it (opus.models.decoder.window_guard):
    the workload's prompt plus new tokens and each text set's seq_len must fit, or the run fails in its
    first stage. Stages with lengths of their own are caught by the guard itself."""
    window = cfg.sliding_window
    if not window:
        return
    spec = loaded.spec
    lengths = [(("workload", "input_len"), spec.workload.input_len + spec.workload.output_len,
                f"input_len + output_len ({spec.workload.input_len} + {spec.workload.output_len})")]
    for name in ("calibration", "evaluation"):
        text_set = getattr(spec.data, name)
        if text_set is not None:
            lengths.append((("data", name, "seq_len"), text_set.seq_len, "seq_len"))
    for loc, length, what in lengths:
        if length > window:
            raise loaded.error(f"{what} = {length} tokens, beyond the model's sliding window of {window}: Opus "
                               f"does not implement sliding-window attention and runs only contexts within it",
                               loc)


def _hf_config(loaded: LoadedPipeline, model_dir: Path) -> Any:
    from opus.models.config import ModelLoadError, config_from_hf

    loc = ("model", "hf")
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise loaded.error(f"{model_dir} is not a directory (an hf model is a directory holding config.json "
                           "and *.safetensors; a .gguf file is model.gguf)", loc)
    if not path.is_file():
        raise loaded.error(f"{path} is missing: not a Hugging Face model directory", loc)
    try:
        raw = json.loads(path.read_bytes())
    except ValueError as exc:  # also a file that is not UTF-8
        raise loaded.error(f"{path}: not valid JSON: {exc}", loc) from None
    if not isinstance(raw, dict):
        raise loaded.error(f"{path}: a JSON object expected, got {type(raw).__name__}", loc)
    try:
        cfg = config_from_hf(raw)
    except ModelLoadError as exc:
        raise loaded.error(f"{path}: {exc}", loc) from None
    except KeyError as exc:
        raise loaded.error(f"{path}: no {exc} (needed to build a {raw.get('model_type')} model)", loc) from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise loaded.error(f"{path}: implausible config: {exc}", loc) from None
    bad = next((name for name in _POSITIVE if getattr(cfg, name) <= 0), None)
    if bad:
        raise loaded.error(f"{path}: implausible config: {bad} is {getattr(cfg, bad)}", loc)
    return cfg


def _safetensors_elements(loaded: LoadedPipeline, files: list[Path]) -> int:
    from safetensors import SafetensorError, safe_open

    total = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    numel = 1
                    for dim in st.get_slice(name).get_shape():
                        numel *= dim
                    total += numel
        except (SafetensorError, OSError) as exc:
            raise loaded.error(f"{path} ({path.stat().st_size} bytes): not a complete safetensors file "
                               f"({exc}); was the download or copy cut short?", ("model", "hf")) from None
    return total


def _check_hf(loaded: LoadedPipeline, model_dir: Path) -> TokenizerLoader:
    from opus.models import hf
    from opus.models.config import ModelLoadError

    _check_window(loaded, _hf_config(loaded, model_dir))
    try:
        files = hf.weight_files(model_dir)
    except ModelLoadError as exc:
        raise loaded.error(str(exc), ("model", "hf")) from None
    _check_memory(loaded, _safetensors_elements(loaded, files), ("model", "hf"))

    def tokenizer() -> Any:
        try:
            return hf.load_hf_tokenizer(model_dir)
        except ModelLoadError as exc:
            raise loaded.error(str(exc), ("model", "hf")) from None

    return tokenizer


def _check_gguf(loaded: LoadedPipeline, path: Path) -> TokenizerLoader:
    import gguf

    from opus.models.config import ModelLoadError
    from opus.models.gguf_file import ARCHES, GGUFMetadata, gguf_field
    from opus.models.gguf_tokenizer import gguf_tokenizer

    loc = ("model", "gguf")
    if not path.is_file():
        raise loaded.error(f"{path} is not a file (a gguf model is one .gguf file)", loc)
    try:
        reader = gguf.GGUFReader(str(path))  # header and tensor table only; the data stays mapped
    except Exception as exc:  # noqa: BLE001 - the gguf package raises bare ValueErrors and worse
        raise loaded.error(f"{path}: not a complete GGUF file ({type(exc).__name__}: {exc})", loc) from None
    arch = str(gguf_field(reader, "general.architecture", ""))
    if arch not in ARCHES:
        raise loaded.error(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                           f"{', '.join(sorted(ARCHES))}", loc)
    missing = [k for k in _REQUIRED_GGUF_KEYS if gguf_field(reader, f"{arch}.{k}") is None]
    if missing:
        raise loaded.error(f"{path}: missing GGUF metadata key {arch}.{missing[0]}", loc)
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise loaded.error(f"{path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} but the file "
                               f"has {size}: truncated", loc)
    # Every tensor is dequantized to float32 first, whatever the pipeline's dtype.
    _check_memory(loaded, sum(int(t.n_elements) for t in reader.tensors), loc, at_least_bytes=4)
    # Built now, not only when text needs it: the loader builds it too (read_gguf) and would fail
    # there, inside the first stage; here it is one line before anything runs.
    try:
        tok = gguf_tokenizer(path, GGUFMetadata(reader))
    except ModelLoadError as exc:
        raise loaded.error(str(exc), loc) from None
    return lambda: tok


def _check_memory(loaded: LoadedPipeline, elements: int, loc: tuple[Any, ...], at_least_bytes: int = 0) -> None:
    """Refuse only weights clearly beyond the machine: more than its total memory (or the GPU's)."""
    import psutil
    import torch

    from opus.models.load import resolve_dtype

    spec = loaded.spec.model
    dtype_size = torch.empty(0, dtype=resolve_dtype(spec.dtype)).element_size()
    need = elements * max(dtype_size, at_least_bytes)
    total = psutil.virtual_memory().total
    if need > total:
        raise loaded.error(f"the weights need {need / GB:.1f} GB in memory to load as {spec.dtype}, more than "
                           f"this machine's {total / GB:.1f} GB", loc)
    if spec.device.startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(int(spec.device.partition(":")[2] or 0)).total_memory
        if elements * dtype_size > gpu:
            raise loaded.error(f"the weights need {elements * dtype_size / GB:.1f} GB as {spec.dtype}, more than "
                               f"the {gpu / GB:.1f} GB of {spec.device}", loc)
