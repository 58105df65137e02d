"""Read a llama.cpp GGUF file into an Opus ModelConfig, float tensors and a tokenizer (gguf_tokenizer).

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (F32/F16/BF16/Q8_0/Q4_0/
K-quants ...): Opus re-quantizes with its own stages. llama.cpp names are mapped back to the
decoder's names, and the Q/K row permutation that ``convert_hf_to_gguf.py`` applies to the
``llama`` architecture (its RoPE rotates interleaved pairs, transformers' rotates halves) is undone.
Qwen architectures use llama.cpp's NeoX RoPE and are stored unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opus.models import layout
from opus.models.config import ModelConfig, ModelLoadError, require_regular_file
from opus.models.gguf_names import BLOCK as _BLOCK  # llama.cpp's names: one table with the GGUF writer
from opus.models.gguf_names import EXPERT_STACKS as _EXPS
from opus.models.gguf_names import PER_EXPERT as _PER_EXPERT
from opus.models.gguf_names import PERMUTED as _PERMUTED
from opus.models.gguf_names import TOP as _TOP
from opus.models.gguf_names import VECTOR as _VECTOR
from opus.models.gguf_tokenizer import gguf_tokenizer

# GGUF general.architecture -> Opus family (llama with experts is Mixtral: layout.family_for_gguf).
ARCHES = layout.GGUF_ARCHES
_D = layout.DECODER


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's ``permute``: rows (head, pair, 2) -> (head, 2, half)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to llama-arch q/k rows (kept for writing test files)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _tensors(reader: Any, path: Path) -> dict[str, torch.Tensor]:
    import gguf

    out = {}
    for t in reader.tensors:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: cannot dequantize type {t.tensor_type.name}: {e}") from e
        out[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: the mmap is read-only
    return out


class GGUFMetadata:
    """A GGUF reader's fields as a read-only ``get(key, default)`` mapping, values decoded on demand."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        return gguf_field(self.reader, key, default)


def config_from_gguf(meta: Mapping[str, Any] | GGUFMetadata, raw: Mapping[str, Any], path: Path | str) -> ModelConfig:
    """A ModelConfig from GGUF metadata (key -> value, as llama.cpp writes it) and the tensors' shapes.

    ``raw`` is read for presence and shapes only (biases, q/k norms, expert sizes), so tests can pass
    any objects with a ``shape``.
    """
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCHES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHES))}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: missing GGUF metadata key {arch}.{name}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in raw:
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported (only the default RoPE)")
    gating = meta.get(f"{arch}.expert_gating_func", 1)
    if gating != 1:  # llama.cpp: 1 = softmax, 2 = sigmoid
        raise ModelLoadError(f"{path}: expert gating function {gating} is not supported (only softmax)")
    hidden, layers = int(key("embedding_length")), int(key("block_count"))
    heads = int(key("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens else raw["token_embd.weight"].shape[0]))
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    fam = layout.family_for_gguf(arch, moe=experts > 0)
    assert fam is not None  # arch is in ARCHES
    family = fam.name
    moe_layers = [f"blk.{i}.ffn_gate_inp.weight" in raw for i in range(layers)]
    moe_inter = next((raw[f"blk.{i}.ffn_gate_exps.weight"].shape[1] for i in range(layers)
                      if f"blk.{i}.ffn_gate_exps.weight" in raw), 0)
    if experts and not moe_inter:  # legacy per-expert Mixtral files: blk.N.ffn_gate.E.weight
        moe_inter = next((raw[k].shape[0] for k in raw if re.match(r"blk\.\d+\.ffn_gate\.\d+\.weight$", k)), 0)
    shared = next((raw[f"blk.{i}.ffn_gate_shexp.weight"].shape[0] for i in range(layers)
                   if f"blk.{i}.ffn_gate_shexp.weight" in raw), 0)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length", 0) or 0),
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in raw,
        qkv_bias="blk.0.attn_q.bias" in raw, o_bias="blk.0.attn_output.bias" in raw,
        mlp_bias="blk.0.ffn_up.bias" in raw, qk_norm="blk.0.attn_q_norm.weight" in raw,
        num_experts=experts, top_k=int(meta.get(f"{arch}.expert_used_count", 0) or 0),
        moe_intermediate_size=int(moe_inter),
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", fam.gguf_norm_topk)),
        shared_expert_intermediate_size=int(shared), moe_layers=moe_layers if experts else [],
        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
    )


def map_gguf_tensors(raw: dict[str, torch.Tensor], cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    """Rename llama.cpp tensors to the decoder's names; unpermute llama-arch q/k; split expert stacks."""
    permuted = any(f.gguf_permuted_qk for f in layout.FAMILY_TABLE if f.gguf_arch == arch)
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        m = re.match(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$", name)
        if not m:
            out[name] = t  # reported as unexpected by build_model, by its GGUF name
            continue
        layer, kind, expert, param = m[1], m[2], m[3], m[4]
        prefix = f"{_D.layers}.{layer}"
        experts = f"{prefix}.{_D.mlp}.{_D.experts}"
        if kind in _EXPS:
            for e in range(t.shape[0]):
                out[f"{experts}.{e}.{_EXPS[kind]}.weight"] = t[e]
        elif expert is not None and kind in _PER_EXPERT:
            out[f"{experts}.{expert}.{_PER_EXPERT[kind]}.weight"] = t
        elif kind in _BLOCK:
            if permuted and kind in _PERMUTED:
                t = unpermute_qk(t, getattr(cfg, _PERMUTED[kind]))
            if kind in _VECTOR:
                t = t.reshape(1, -1)  # llama.cpp stores the shared-expert gate as a vector
            out[f"{prefix}.{_BLOCK[kind]}.{param}"] = t
        else:
            out[name] = t
    return out


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    """(config, tensors named for the decoder, tokenizer) from a GGUF file; no tokenizer is an error."""
    import gguf

    require_regular_file(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueErrors on foreign files
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from e
    raw = _tensors(reader, path)
    cfg = config_from_gguf(GGUFMetadata(reader), raw, path)
    tokenizer = gguf_tokenizer(path, GGUFMetadata(reader))
    arch = str(gguf_field(reader, "general.architecture"))
    return cfg, map_gguf_tensors(raw, cfg, arch), tokenizer
