"""The optimized model as one GGUF file with the plan's mix: each layer in the GGUF type of its format.

llama.cpp and everything built on it (llama-cpp-python, Ollama, LM Studio) run the file. A layer's
type is its format's ``export.gguf`` in the format registry (w8a8/w8a16 -> Q8_0, w4a16 -> Q4_K,
bf16 -> BF16, fp32 -> F32 ...): the exporter never names a format. The weight written is the one the
optimized model computes with (``opus.export.unfused``: fused layers split back, experts unstacked,
SmoothQuant's factors already folded), quantized again by gguf-py (``gguf.quants.quantize``), except
Q4_K, which gguf-py cannot quantize (``gguf_q4k``). Embeddings stay as the model holds them, norms
and biases F32, as llama.cpp's converter writes them.

A layer that cannot take its type is stored in the next more accurate one that fits
(``FALLBACK``), as ``llama-quantize`` does: Q4_K needs rows of a multiple of 256 weights, else Q5_0;
a 32-block type needs a multiple of 32, else F16 (F32 where F16 would overflow). A format GGUF has no
type for (fp8) is dequantized to F16. Each such layer is named in ``layers_not_as_planned``.

Names, the Q/K row permutation of the llama architecture and the expert stacks are the inverse of
``opus.models.gguf_file`` through the one table in ``opus.models.gguf_names``; the metadata are the
keys that reader and llama.cpp read. The tokenizer: ``gguf_vocab``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from opus.export.settings import ExportSettings, one_line
from opus.export.targets import TargetOutcome
from opus.export.unfused import Layer, layers, other_tensors
from opus.models import layout
from opus.models.gguf_names import BLOCK, EXPERT_STACKS, PERMUTED, TOP, VECTOR
from opus.quant.formats import FORMATS
from opus.quant.tied import SharedInt8Embedding

FILE = "gguf/model.gguf"
# GGUF types Opus writes, least to most accurate (mean error on Gaussian weights, tests check the
# order); a layer whose shape a type cannot take moves up to the first one that fits.
FALLBACK = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q8_0", "F16", "F32")
NO_TYPE = "F16"  # a format GGUF has no type for is stored dequantized
_D = layout.DECODER
QUANTIZING = "GGUF: quantizing tensors to the plan's types (layers)"
_LAYER = re.compile(rf"^{re.escape(_D.layers)}\.(\d+)\.(.+)$")
_EXPERT = re.compile(rf"^{re.escape(_D.mlp)}\.{re.escape(_D.experts)}\.(\d+)\.(\w+)$")
_BLOCK_OF = {path: name for name, path in BLOCK.items()}
_STACK_OF = {proj: name for name, proj in EXPERT_STACKS.items()}
_TOP_OF = {path: name for name, path in TOP.items()}


class Unsupported(ValueError):
    """This model has no GGUF form Opus can write; the message is the one-line reason."""


def _qtype(name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[name]


def block_size(type_name: str) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[_qtype(type_name)][0]


def stored_type(planned: str | None, in_features: int, weight: np.ndarray) -> tuple[str, str | None]:
    """(the GGUF type a matrix is written in, why it is not ``planned`` or None)."""
    if planned is None:
        wanted, why = NO_TYPE, "the format has no GGUF type: stored dequantized"
    else:
        wanted, why = planned, None
    if in_features % block_size(wanted) == 0 and not _overflows(wanted, weight):
        return wanted, why
    start = FALLBACK.index(wanted) + 1 if wanted in FALLBACK else 0
    for candidate in FALLBACK[start:]:
        if in_features % block_size(candidate) == 0 and not _overflows(candidate, weight):
            reason = (f"{wanted} needs rows of a multiple of {block_size(wanted)} weights (in_features "
                      f"{in_features})" if in_features % block_size(wanted) else f"{wanted} would overflow")
            return candidate, f"{why}; {reason}" if why else reason
    raise Unsupported(f"no GGUF type fits a matrix of {in_features} columns")


def _overflows(type_name: str, weight: np.ndarray) -> bool:
    return type_name == "F16" and bool(np.abs(weight).max(initial=0.0) >= 65504)


def encode(weight: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """(the array GGUFWriter.add_tensor takes, its raw_dtype) for a float matrix in ``type_name``."""
    import gguf

    from opus.export.gguf_q4k import quantize_q4_k

    qtype = _qtype(type_name)
    arr = np.ascontiguousarray(weight, dtype=np.float32)
    if type_name == "F32":
        return arr, None
    if type_name == "F16":
        return arr.astype(np.float16), None
    if type_name == "Q4_K":
        return quantize_q4_k(arr), qtype
    return gguf.quants.quantize(arr, qtype), qtype


class _Tensors:
    """The file's tensors, collected before writing: name -> (array, raw_dtype, type name, weights)."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[np.ndarray, Any, str, int]] = {}
        self.not_as_planned: dict[str, str] = {}
        self.formats: Counter[str] = Counter()  # "w8a8 -> Q8_0": original layers

    def add(self, name: str, weight: np.ndarray, type_name: str) -> None:
        data, raw = encode(weight, type_name)
        self.items[name] = (data, raw, type_name, int(weight.size))

    def add_float(self, name: str, tensor: torch.Tensor) -> None:
        """Embeddings, norms, biases: F32, or the 16-bit type the model holds a matrix in."""
        kinds = {torch.float16: "F16", torch.bfloat16: "BF16"}
        type_name = kinds.get(tensor.dtype, "F32") if tensor.dim() > 1 else "F32"
        if type_name == "BF16":
            import gguf

            arr = tensor.detach().float().cpu().numpy()
            self.items[name] = (gguf.quants.quantize(arr, _qtype("BF16")), _qtype("BF16"), "BF16", arr.size)
        else:
            self.add(name, tensor.detach().float().cpu().numpy(), type_name)

    def add_matrix(self, name: str, group: list[Layer], weight: np.ndarray) -> None:
        """One GGUF matrix made of ``group`` (one layer, or the stacked experts of one projection)."""
        planned_by = {FORMATS[layer.fmt].export.gguf if layer.fmt in FORMATS else None for layer in group}
        planned = max(planned_by, key=lambda t: FALLBACK.index(t) if t in FALLBACK else -1)
        in_features = weight.shape[-1]
        type_name, why = stored_type(planned, in_features, weight)
        if len(planned_by) > 1:
            why = f"{why}; " if why else ""
            why += f"its experts were planned in {sorted(map(str, planned_by))}: one GGUF tensor holds all"
        for layer in group:
            self.formats[f"{layer.fmt} -> {type_name}"] += 1
            if why:
                self.not_as_planned[layer.name] = f"{type_name} instead of {planned or layer.fmt}: {why}"
        self.add(name, weight, type_name)


def _permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    from opus.models.gguf_file import permute_qk

    return permute_qk(rows, n_head)


def _collect(model: nn.Module, cfg: Any, fam: layout.Family, progress: Callable[..., None]) -> _Tensors:
    """Every layer's tensors in llama.cpp's names and types; ``progress(what, done, total)`` per layer."""
    out = _Tensors()
    found = layers(model)
    stacks: dict[tuple[int, str], dict[int, Layer]] = defaultdict(dict)
    embedding = model.get_submodule(_D.embedding)
    shared = isinstance(embedding, SharedInt8Embedding)  # the embedding reads the int8 lm_head's rows
    for done, (name, layer) in enumerate(found.items()):
        progress(QUANTIZING, done, len(found))
        if name == _D.lm_head:
            own = getattr(layer.module, "weight", None)  # a quantized lm_head (its own int8 copy) has none
            if isinstance(own, torch.Tensor) and own.data_ptr() == embedding.weight.data_ptr():
                continue  # tied: llama.cpp reads token_embd when output.weight is absent
            # One table there too: token_embd in the head's format, and no output.weight.
            top = _TOP_OF[f"{_D.embedding}.weight" if shared else f"{name}.weight"]
            out.add_matrix(top, [layer], layer.weight.cpu().numpy())
            continue
        m = _LAYER.match(name)
        if not m:
            raise Unsupported(f"layer {name}: no llama.cpp tensor for it")
        block, rest = int(m[1]), m[2]
        if (e := _EXPERT.match(rest)) and e[2] in _STACK_OF:
            stacks[(block, _STACK_OF[e[2]])][int(e[1])] = layer
            continue
        kind = _BLOCK_OF.get(rest)
        if kind is None:
            raise Unsupported(f"layer {name}: no llama.cpp tensor for it")
        weight, bias = layer.weight, layer.bias
        if fam.gguf_permuted_qk and kind in PERMUTED:
            heads = getattr(cfg, PERMUTED[kind])
            weight = _permute(weight, heads)
            bias = _permute(bias, heads) if bias is not None else None
        if kind in VECTOR:  # a [1, in] linear that llama.cpp keeps as a vector: stored F32
            out.formats[f"{layer.fmt} -> F32"] += 1
            if not FORMATS[layer.fmt].is_noop:
                out.not_as_planned[name] = "F32 instead of the plan's format: llama.cpp keeps this gate a vector"
            out.add(f"blk.{block}.{kind}.weight", weight.reshape(-1).cpu().numpy(), "F32")
        else:
            out.add_matrix(f"blk.{block}.{kind}.weight", [layer], weight.cpu().numpy())
        if bias is not None:
            out.add_float(f"blk.{block}.{kind}.bias", bias)
    for (block, kind), experts in sorted(stacks.items()):
        if sorted(experts) != list(range(len(experts))) or len(experts) != cfg.num_experts:
            raise Unsupported(f"layer {block}: experts {sorted(experts)} are not 0..{cfg.num_experts - 1}")
        group = [experts[e] for e in range(len(experts))]
        if any(layer.bias is not None for layer in group):
            raise Unsupported(f"layer {block}: expert biases have no llama.cpp tensor")
        weight = torch.stack([layer.weight for layer in group]).cpu().numpy()
        out.add_matrix(f"blk.{block}.{kind}.weight", group, weight)
    for name, tensor in other_tensors(model).items():
        if shared and name == f"{_D.embedding}.weight":
            continue  # written above, from the head
        if name in _TOP_OF:
            out.add_float(_TOP_OF[name], tensor)
            continue
        m = _LAYER.match(name)
        kind = _BLOCK_OF.get(m[2].rpartition(".")[0]) if m else None
        if kind is None or not name.endswith(".weight"):
            raise Unsupported(f"tensor {name}: no llama.cpp tensor for it")
        out.add_float(f"blk.{m[1]}.{kind}.weight", tensor)
    return out


def _check_model(model: nn.Module) -> tuple[Any, layout.Family]:
    from opus.models.config import ModelConfig

    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise Unsupported(f"{type(model).__name__} is not an Opus decoder (GGUF needs a known family's layout)")
    fam = layout.family(cfg.family)
    if not fam.gguf_arch:
        raise Unsupported(f"family {cfg.family} has no llama.cpp architecture")
    if cfg.num_experts and not all(cfg.moe_layers):
        raise Unsupported(f"{cfg.family} with dense layers between the MoE ones: llama.cpp's {fam.gguf_arch} "
                          "expects experts in every layer")
    return cfg, fam


def _metadata(writer: Any, cfg: Any, fam: layout.Family, settings: ExportSettings, main_type: str) -> None:
    import gguf

    source = settings.source
    name = next((Path(str(source[k])).stem for k in ("hf", "gguf") if k in source), None) or cfg.family
    writer.add_name(f"{name} (Opus plan)")
    # A sliding window is plain causal attention within it, and Opus refuses longer contexts; llama.cpp's
    # llama architecture has no window: the file's trained context is the window, so it warns beyond it.
    window = getattr(cfg, "sliding_window", None)
    writer.add_context_length(min(cfg.max_position_embeddings, window or cfg.max_position_embeddings))
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    # llama.cpp's llama architecture sizes Mixtral's experts by feed_forward_length
    writer.add_feed_forward_length(cfg.moe_intermediate_size if fam.moe == "mixtral" else cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.top_k)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
        if fam.moe != "mixtral":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    file_type = next((getattr(gguf.LlamaFileType, n) for n in (f"MOSTLY_{main_type}", f"MOSTLY_{main_type}_M")
                      if hasattr(gguf.LlamaFileType, n)), gguf.LlamaFileType.ALL_F32)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write(model: nn.Module, tokenizer: Any, path: Path, settings: ExportSettings) -> tuple[dict, dict]:
    import gguf

    from opus.export.gguf_vocab import add_tokenizer, check_roundtrip

    cfg, fam = _check_model(model)
    with torch.no_grad():
        tensors = _collect(model, cfg, fam, settings.progress)
    weights: Counter[str] = Counter()
    for _, _, type_name, size in tensors.items.values():
        weights[type_name] += size
    main_type = max((t for t in weights if t not in ("F32", "F16", "BF16")), key=weights.__getitem__,
                    default="F32")
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), fam.gguf_arch, use_temp_file=True)
    try:
        _metadata(writer, cfg, fam, settings, main_type)
        vocab = add_tokenizer(writer, tokenizer, cfg.vocab_size, cfg.bos_token_id,
                              cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None)
        for name, (data, raw, _, _) in tensors.items.items():
            writer.add_tensor(name, data, raw_dtype=raw)
        settings.progress("GGUF: writing the file")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, path)
    vocab["roundtrip"] = check_roundtrip(path, tokenizer, vocab) or "same ids as the source tokenizer"
    total = sum(weights.values())
    info = {
        "architecture": fam.gguf_arch,
        "tensor_types": dict(Counter(t for _, _, t, _ in tensors.items.values())),
        "tensor_type_mix": {t: round(n / total, 4) for t, n in weights.most_common()},
        "layer_formats": dict(sorted(tensors.formats.items())),
        "tokenizer": vocab,
    }
    return info, tensors.not_as_planned


def export_gguf(model: nn.Module, tokenizer: Any, state: dict[str, Any], out_dir: Path,
                settings: ExportSettings) -> TargetOutcome:
    """Write ``out_dir/gguf/model.gguf``; a model it cannot write is ``exported=False`` with the reason."""
    from opus.export.gguf_vocab import VocabError

    path = Path(out_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        info, not_as_planned = _write(model, tokenizer, path, settings)
    except (Unsupported, VocabError) as exc:
        return TargetOutcome("gguf", False, reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one target failing must not end the export stage
        return TargetOutcome("gguf", False, reason=f"GGUF writing failed: {one_line(exc)}")
    finally:
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        if not path.is_file():
            shutil.rmtree(path.parent, ignore_errors=True)  # nothing half-written is left to look like an export
    info["recipe_steps"] = len(state.get("recipe", []))
    return TargetOutcome("gguf", True, path=FILE, metrics={"gguf_file_mb": path.stat().st_size / 2**20},
                         info=info, layers_not_as_planned=not_as_planned)
