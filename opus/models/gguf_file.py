"""Read a llama.cpp GGUF file into an Opus ModelConfig, float tensors and (when practical) a tokenizer.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (F32/F16/BF16/Q8_0/Q4_0/
K-quants ...): Opus re-quantizes with its own stages. llama.cpp names are mapped back to the
decoder's names, and the Q/K row permutation that ``convert_hf_to_gguf.py`` applies to the
``llama`` architecture (its RoPE rotates interleaved pairs, transformers' rotates halves) is undone.
Qwen architectures use llama.cpp's NeoX RoPE and are stored unpermuted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opus.models.config import ModelConfig, ModelLoadError

# GGUF general.architecture -> Opus family (llama with experts is Mixtral).
ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_NORM_TOPK_DEFAULT = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}  # llama.cpp's per-arch choice
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
# Pre-tokenizer split patterns for byte-level BPE vocabularies (tokenizer.ggml.pre).
_PRE_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's ``permute``: rows (head, pair, 2) -> (head, 2, half)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to llama-arch q/k rows (kept for writing test files)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
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


def _config(reader: Any, raw: dict[str, torch.Tensor], path: Path) -> ModelConfig:
    arch = str(_field(reader, "general.architecture", ""))
    if arch not in ARCHES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHES))}")

    def key(name: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: missing GGUF metadata key {arch}.{name}")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in raw:
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported (only the default RoPE)")
    gating = _field(reader, f"{arch}.expert_gating_func", 1)
    if gating != 1:  # llama.cpp: 1 = softmax, 2 = sigmoid
        raise ModelLoadError(f"{path}: expert gating function {gating} is not supported (only softmax)")
    hidden, layers = int(key("embedding_length")), int(key("block_count"))
    heads = int(key("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else raw["token_embd.weight"].shape[0]))
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    family = "mixtral" if arch == "llama" and experts else ARCHES[arch]
    moe_layers = [f"blk.{i}.ffn_gate_inp.weight" in raw for i in range(layers)]
    moe_inter = next((raw[f"blk.{i}.ffn_gate_exps.weight"].shape[1] for i in range(layers)
                      if f"blk.{i}.ffn_gate_exps.weight" in raw), 0)
    if experts and not moe_inter:  # legacy per-expert Mixtral files: blk.N.ffn_gate.E.weight
        moe_inter = next((raw[k].shape[0] for k in raw if re.match(r"blk\.\d+\.ffn_gate\.\d+\.weight$", k)), 0)
    shared = next((raw[f"blk.{i}.ffn_gate_shexp.weight"].shape[0] for i in range(layers)
                   if f"blk.{i}.ffn_gate_shexp.weight" in raw), 0)
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", 0) or 0),
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in raw,
        qkv_bias="blk.0.attn_q.bias" in raw, o_bias="blk.0.attn_output.bias" in raw,
        mlp_bias="blk.0.ffn_up.bias" in raw, qk_norm="blk.0.attn_q_norm.weight" in raw,
        num_experts=experts, top_k=int(_field(reader, f"{arch}.expert_used_count", 0) or 0),
        moe_intermediate_size=int(moe_inter),
        norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", _NORM_TOPK_DEFAULT.get(family, True))),
        shared_expert_intermediate_size=int(shared), moe_layers=moe_layers if experts else [],
        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
    )


def map_gguf_tensors(raw: dict[str, torch.Tensor], cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    """Rename llama.cpp tensors to the decoder's names; unpermute llama-arch q/k; split expert stacks."""
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
        prefix = f"model.layers.{layer}"
        if kind in _EXPS:
            for e in range(t.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.{_EXPS[kind]}.weight"] = t[e]
        elif expert is not None and kind in ("ffn_gate", "ffn_up", "ffn_down"):
            out[f"{prefix}.mlp.experts.{expert}.{kind[4:]}_proj.weight"] = t
        elif kind in _BLOCK:
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                t = unpermute_qk(t, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
            if kind == "ffn_gate_inp_shexp":
                t = t.reshape(1, -1)  # llama.cpp stores the shared-expert gate as a vector
            out[f"{prefix}.{_BLOCK[kind]}.{param}"] = t
        else:
            out[name] = t
    return out


def gguf_tokenizer(reader: Any) -> Any | None:
    """A PreTrainedTokenizerFast for byte-level BPE ("gpt2") vocabularies; None for others (SPM...)."""
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        return None
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if pre not in ("default", "gpt-2", *_PRE_REGEX):
        return None  # an unknown split rule would tokenize differently: better no tokenizer than a wrong one
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre in _PRE_REGEX:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type") or []
    control = [tokens[i] for i, ty in enumerate(types) if ty == 3]  # 3 = CONTROL (special) tokens
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def name(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=name("tokenizer.ggml.bos_token_id"),
                                   eos_token=name("tokenizer.ggml.eos_token_id"))


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Any | None]:
    """(config, tensors named for the decoder, tokenizer or None) from a GGUF file."""
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueErrors on foreign files
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from e
    raw = _tensors(reader, path)
    cfg = _config(reader, raw, path)
    arch = str(_field(reader, "general.architecture"))
    return cfg, map_gguf_tensors(raw, cfg, arch), gguf_tokenizer(reader)
