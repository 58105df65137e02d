"""Helpers for the model tests: tiny transformers models, a plain KV cache, a GGUF writer.

The GGUF writer deliberately does not reuse Opus's reader tables: names come from the gguf
package's own ``TensorNameMap`` and the Q/K permutation is llama.cpp's ``convert_hf_to_gguf``
code, so a reader bug cannot be mirrored by a writer bug.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as tf  # noqa: E402

from opus.kv.cache import CacheBase  # noqa: E402

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
# family -> (config class, model class, extra config kwargs)
FAMILY_CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(intermediate_size=96)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(intermediate_size=96)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(intermediate_size=96, head_dim=24)),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True)),
    # A window longer than the parity tests' 12 tokens: Opus runs Mistral within its window only.
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(intermediate_size=96, sliding_window=16)),
    # One local and one global layer (RoPE bases 1e4 and 1e6), a softmax scale 256 ** -0.5 unlike head_dim's.
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
               dict(intermediate_size=96, head_dim=16, sliding_window=16, query_pre_attn_scalar=256,
                    layer_types=["sliding_attention", "full_attention"])),
}


def make_hf(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny transformers model with weights big enough that parity tests mean something."""
    cfg_cls, model_cls, extra = FAMILY_CASES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**COMMON, **extra, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the default init (std 0.02, unit norms) gives near-zero logits
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model


def save_hf(model: Any, path: Path, **kw: Any) -> Path:
    model.save_pretrained(path, **kw)
    return path


class GrowingCache(CacheBase):
    """The simplest KV cache honouring Opus's contract: update(i, k, v) returns all keys so far."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------- GGUF writing, llama.cpp style
# llama.cpp's converter files Mistral under "llama" (permuted q/k, the sliding window dropped).
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """Verbatim logic of convert_hf_to_gguf.LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def hf_state_for_gguf(model: Any) -> dict[str, torch.Tensor]:
    """transformers' in-memory state with fused experts split into per-kind stacks [E, out, in]."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    return out


def write_gguf(model: Any, family: str, path: Path, qtype: str = "F32", tokenizer: Any = None) -> Path:
    """Write a transformers model as llama.cpp's convert_hf_to_gguf.py would (F32 or Q8_0 matrices).

    ``tokenizer``: a byte-level BPE ``tokenizers.Tokenizer`` (written with pre ``gpt-2``), or the
    ``tokenizer.ggml.*`` fields themselves (``byte_level_fields`` or hand-made, see ``add_vocab``).
    """
    import gguf

    c = model.config
    arch = GGUF_ARCH[family]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", 0)
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if tokenizer is None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    else:
        add_vocab(w, tokenizer if isinstance(tokenizer, dict) else byte_level_fields(tokenizer))
    for name, t in hf_state_for_gguf(model).items():
        t = t.detach().float()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_cpp_permute(t, c.num_attention_heads, c.num_attention_heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_cpp_permute(t, c.num_attention_heads, c.num_key_value_heads)
        new = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"no GGUF name for {name}"
        arr = t.numpy()
        if qtype == "Q8_0" and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            w.add_tensor(new, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(new, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level_fields(tok: Any, pre: str | None = "gpt-2") -> dict[str, Any]:
    """A byte-level BPE tokenizer's vocabulary and merges as llama.cpp stores them for 'gpt2' tokenizers."""
    import json

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in data["added_tokens"] if a["special"]}
    return {"model": "gpt2", "pre": pre, "tokens": tokens,
            "merges": [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]],
            "types": [3 if t in specials else 1 for t in tokens], "eos": vocab.get("<|endoftext|>")}


def add_vocab(w: Any, fields: dict[str, Any]) -> None:
    """Write tokenizer.ggml.* fields (model, pre, tokens, merges, scores, types, bos, eos); None skips one."""
    w.add_tokenizer_model(fields["model"])
    w.add_token_list(fields["tokens"])
    for key, add in (("pre", w.add_tokenizer_pre), ("merges", w.add_token_merges), ("scores", w.add_token_scores),
                     ("types", w.add_token_types), ("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id)):
        if fields.get(key) is not None:
            add(fields[key])


def make_factory_model(hidden: int = 8) -> torch.nn.Module:
    """Target of the factory-source test: any nn.Module goes."""
    return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def hf_factory(family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """Target of the transformers-factory tests: a tiny transformers causal LM (``make_hf``)."""
    return make_hf(family, seed, **overrides)


def gpt2_factory() -> Any:
    """A transformers causal LM of a family Opus has no row for."""
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                             bos_token_id=0, eos_token_id=0))


def llama_trunk_factory() -> Any:
    """A known family, but the trunk without its lm_head."""
    return tf.LlamaModel(tf.LlamaConfig(**COMMON, intermediate_size=96))
