"""Turn a pipeline's ``model:`` source into an ``nn.Module`` (and a tokenizer when there is one).

Sources::

    {"hf": DIR}                                   config.json + *.safetensors (+ tokenizer.json)
    {"hf": "org/name"}                            the same, from the local Hugging Face cache (opus.models.hub)
    {"gguf": FILE}                                a llama.cpp GGUF file, dequantized to float (+ its tokenizer)
    {"factory": "pkg.module:function", "args": {...}}   any nn.Module (the generic path); a transformers
                                                  causal LM of a known family becomes Opus's decoder

Relative paths resolve against ``base_dir`` (the pipeline file's directory).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opus import trust
from opus.models import layout
from opus.models.config import FAMILIES, ModelConfig, ModelLoadError, config_from_hf
from opus.models.decoder import DecoderLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
SOURCE_KINDS = ("hf", "gguf", "factory")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _source_kind(source: dict[str, Any]) -> str:
    kinds = [k for k in SOURCE_KINDS if k in source]
    if len(kinds) != 1:
        raise ModelLoadError(f"model source must have exactly one of {', '.join(SOURCE_KINDS)}; got keys "
                             f"{sorted(source)}")
    return kinds[0]


def _resolve(path: str | Path, base_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", origin: str = "checkpoint") -> DecoderLM:
    """Build a DecoderLM from renamed tensors; every mismatch raises a ModelLoadError naming the tensor."""
    torch_dtype = resolve_dtype(dtype)
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        model = DecoderLM(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{origin}: missing tensor {missing[0]}{more}")
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelLoadError(f"{origin}: unexpected tensor {unexpected[0]}{more} for family {cfg.family}")
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{origin}: tensor {name} has shape {tuple(t.shape)}, model expects {tuple(shape)}")
        state[name] = t.to(device=device, dtype=torch_dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def load_model(source: dict[str, Any], base_dir: Path | str = ".", dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> tuple[nn.Module, Any | None]:
    """Load a model source; returns ``(model, tokenizer or None)``.

    The tokenizer is a ``transformers.PreTrainedTokenizerFast`` for hf and gguf sources (None for an
    hf directory without one; a GGUF's is built by transformers' GGUF conversion, and one it cannot
    build is a ModelLoadError: opus.models.gguf_tokenizer), or whatever a factory returned as the
    second item of a tuple.
    """
    base_dir = Path(base_dir)
    kind = _source_kind(source)
    if kind == "hf":
        from opus.models import hf
        from opus.models.hub import resolve_hf_dir

        model_dir = resolve_hf_dir(source["hf"], base_dir)
        _, cfg = hf.read_config(model_dir)
        model = build_model(cfg, hf.read_hf_tensors(model_dir, cfg), dtype, device, origin=str(model_dir))
        return model, hf.load_hf_tokenizer(model_dir)
    if kind == "gguf":
        from opus.models import gguf_file

        path = _resolve(source["gguf"], base_dir)
        cfg, tensors, tokenizer = gguf_file.read_gguf(path)
        return build_model(cfg, tensors, dtype, device, origin=str(path)), tokenizer
    return _load_factory(source, base_dir, dtype, device)


def _import_factory(spec: str, base_dir: Path) -> Callable[..., Any]:
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ModelLoadError(f"factory {spec!r} must look like 'package.module:function'")
    # Named in a run or an export being loaded: called only with trust_code, and from installed code.
    trust.check_call(spec, "the model source's factory")
    # A user's model file beside the pipeline YAML should import without installing anything (their own
    # pipeline only: a loaded directory is never put on the import path).
    added = trust.current() is None and str(base_dir.resolve()) not in sys.path
    if added:
        sys.path.insert(0, str(base_dir.resolve()))
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelLoadError(f"factory {spec!r}: cannot import module {mod_name!r}: {e}") from e
    finally:
        if added:
            sys.path.remove(str(base_dir.resolve()))
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ModelLoadError(f"factory {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    return fn


def is_transformers_model(model: object) -> bool:
    """A transformers ``PreTrainedModel`` (without importing transformers when nothing has)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def transformers_config(model: nn.Module, origin: str) -> ModelConfig:
    """The decoder config of a transformers causal LM of a family Opus knows; else a ModelLoadError
    naming its class. Its weights are not read (preflight calls this on a model built on meta)."""
    cls = type(model).__name__
    raw = model.config.to_dict()
    fam = layout.family_for_model_type(raw.get("model_type"))
    if fam is None:
        raise ModelLoadError(
            f"{origin} returned {cls} (model_type {raw.get('model_type')!r}), a transformers model of a family Opus "
            f"cannot load into its own decoder, which every stage drives; supported: {', '.join(sorted(FAMILIES))}")
    if not any(c.__name__ == fam.hf_architecture for c in type(model).__mro__):
        raise ModelLoadError(f"{origin} returned {cls}, not a {fam.hf_architecture}: Opus needs the causal LM "
                             "(with its lm_head)")
    try:
        return config_from_hf(raw)
    except ModelLoadError as e:
        raise ModelLoadError(f"{origin} returned {cls}: {e}") from None
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise ModelLoadError(f"{origin} returned {cls} with an implausible config: {e!r}") from None


def from_transformers(model: nn.Module, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                      origin: str = "factory") -> DecoderLM:
    """A transformers causal LM of a known family as Opus's decoder: its config through ``config_from_hf``
    and its state dict through the checkpoint name mapping of opus.models.hf (fused experts unfused)."""
    from opus.models.hf import map_hf_tensors

    cfg = transformers_config(model, origin)
    tensors = map_hf_tensors(iter(model.state_dict().items()), cfg)
    return build_model(cfg, tensors, dtype, device, origin=f"{origin} ({type(model).__name__})")


def check_factory(source: dict[str, Any], base_dir: Path | str = ".") -> ModelConfig | None:
    """What can be known of a factory before a run: it imports, its function exists and, called once on
    the meta device (no weights allocated, the RNG untouched), a transformers model it returns is one
    ``from_transformers`` takes (its config is returned; None for anything else). A factory that cannot run
    on meta (``from_pretrained``) is left to the load."""
    spec = str(source["factory"])
    fn = _import_factory(spec, Path(base_dir))
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn(**dict(source.get("args") or {}))
    except Exception:  # noqa: BLE001 - user code; the real load reports its own error
        return None
    model = result[0] if isinstance(result, tuple) and result else result
    if is_transformers_model(model):
        return transformers_config(model, f"factory {spec!r}")
    return model.config if isinstance(model, DecoderLM) else None


def _load_factory(source: dict[str, Any], base_dir: Path, dtype: str | torch.dtype,
                  device: str | torch.device) -> tuple[nn.Module, Any | None]:
    spec = str(source["factory"])
    fn = _import_factory(spec, base_dir)
    result = fn(**dict(source.get("args") or {}))
    model, tokenizer = result if isinstance(result, tuple) else (result, None)
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"factory {spec!r} returned {type(model).__name__}, expected an nn.Module")
    if is_transformers_model(model):  # its forward returns a ModelOutput and takes no Opus cache
        return from_transformers(model, dtype, device, origin=f"factory {spec!r}"), tokenizer
    return model.to(device=device, dtype=resolve_dtype(dtype)).eval(), tokenizer
