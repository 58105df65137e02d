"""The one description of a model's layout: roles, the decoder's module paths, format groups, families.

Every supported family loads into the one module tree of ``opus.models.decoder``, so profiling,
quantization, smoothing, fusion and the GPU decoder all read the names they need from here instead
of spelling them out. Adding a family is one row of ``FAMILY_TABLE`` plus its reference case in
tests/models/opus_model_kit.py (tests/models/test_layout.py insists on both); only a family whose
config.json spells MoE in a new way also needs a branch in ``config_from_hf``.

- ``ROLES``: the one role vocabulary. ``module_roles(model)`` gives every named module its role;
  profiling sums time per role, quantization labels each format group with the role of its layers.
- ``DECODER``: module paths in the decoder (q/k/v/o, gate/up/down, experts, router, norms ...).
- ``format_group(name)``: the group a linear must share a format with (q/k/v; gate/up; the experts
  of one layer). Group names are written into plans and checkpoints: they must never change.
- ``FAMILY_TABLE``: HF architecture / model_type / GGUF architecture -> the family's settings,
  read by ``opus.models.config`` (config.json) and ``opus.models.gguf_file`` (GGUF metadata).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

ROLES = ("attention", "experts", "router", "mlp", "norms", "embedding", "lm_head", "other")


@dataclass(frozen=True)
class DecoderLayout:
    """Module names of ``opus.models.decoder`` (Hugging Face's, so a name a user knows means the same)."""

    layers: str = "model.layers"
    attention: str = "self_attn"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    mlp: str = "mlp"  # a dense SwiGLU, or the sparse MoE block
    gate_proj: str = "gate_proj"  # SwiGLU parts: of the dense MLP, of each expert, of the shared expert
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    experts: str = "experts"  # inside the MoE block: a ModuleList of SwiGLUs
    shared_expert: str = "shared_expert"
    router: str = "gate"  # the MoE block's routing linear
    shared_expert_gate: str = "shared_expert_gate"
    input_norm: str = "input_layernorm"  # per layer, before attention
    post_attention_norm: str = "post_attention_layernorm"  # per layer, before the MLP / MoE (see mlp_norm)
    # Sandwich norms (gemma3): post_attention_layernorm normalises the attention output, these two the MLP's
    # input and output.
    pre_feedforward_norm: str = "pre_feedforward_layernorm"
    post_feedforward_norm: str = "post_feedforward_layernorm"
    embedding: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    lm_head: str = "lm_head"
    # Suffixes of fused names: format groups (``<attn>.qkv``) and fused linears (``<attn>.qkv_proj``).
    qkv_group: str = "qkv"
    gate_up_group: str = "gate_up"

    @property
    def qkv(self) -> tuple[str, str, str]:
        return self.q_proj, self.k_proj, self.v_proj

    @property
    def gate_up(self) -> tuple[str, str]:
        return self.gate_proj, self.up_proj

    @property
    def swiglu(self) -> tuple[str, str, str]:
        return self.gate_proj, self.up_proj, self.down_proj

    def layer(self, i: int) -> str:
        return f"{self.layers}.{i}"

    def attention_of(self, i: int) -> str:
        return f"{self.layer(i)}.{self.attention}"

    def mlp_of(self, i: int) -> str:
        return f"{self.layer(i)}.{self.mlp}"

    def mlp_norm(self, layer: nn.Module) -> str:
        """The name of the norm that feeds a decoder layer's MLP / MoE (within the layer)."""
        sandwich = getattr(layer, self.pre_feedforward_norm, None) is not None
        return self.pre_feedforward_norm if sandwich else self.post_attention_norm


DECODER = DecoderLayout()
_D = DECODER


def swiglu_parts(mlp: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """(gate, up, down) of a SwiGLU module — dense MLP, expert or shared expert — else None."""
    parts = [getattr(mlp, n, None) for n in _D.swiglu]
    return None if any(p is None for p in parts) else (parts[0], parts[1], parts[2])


# -- roles ------------------------------------------------------------------------------------------
# Name parts per role: the decoder's own names first, then other Hugging Face spellings, so a model
# that is not an Opus decoder is still profiled by role.
_ATTENTION = {_D.attention, _D.rotary.rpartition(".")[2], "attn", "attention", "self_attention", "cross_attn",
              "rotary"}
_EXPERTS = {_D.experts, _D.shared_expert, "shared_experts"}
_ROUTERS = {"router", _D.shared_expert_gate}
_MLP = {_D.mlp, "ffn", "feed_forward", "feedforward", "ff"}
_HEADS = {_D.lm_head, "output", "embed_out"}


def moe_blocks(names: list[str] | set[str]) -> set[str]:
    """Names of MoE blocks: modules with an ``experts`` child (their own time is routing and dispatch)."""
    tail = f".{_D.experts}"
    return {n[: -len(_D.experts)].rstrip(".") for n in names if n == _D.experts or n.endswith(tail)}


def role_of(name: str, module: nn.Module | None = None, blocks: set[str] | None = None) -> str:
    """The role of one module. ``blocks`` (``moe_blocks``) tells a router ``gate`` from other gates;
    without it the decoder's own spelling (``<mlp>.gate``) is the rule."""
    if not name:
        return "other"
    parts = name.split(".")
    parent = name.rpartition(".")[0]
    in_moe = parent in blocks if blocks is not None else parts[-2:-1] == [_D.mlp]
    if _EXPERTS & set(parts):
        return "experts"
    if (blocks is not None and name in blocks) or parts[-1] in _ROUTERS or (parts[-1] == _D.router and in_moe):
        return "router"  # an MoE block's own time (softmax, top-k, gathers) is routing too
    if _ATTENTION & set(parts):
        return "attention"  # q/k norms and RoPE included: they are part of attention's cost
    if isinstance(module, nn.Embedding) or any(p.startswith("embed") and p != "embed_out" for p in parts):
        return "embedding"
    if name in _HEADS:
        return "lm_head"
    kind = type(module).__name__.lower() if module is not None else ""
    if "norm" in kind or "norm" in parts[-1] or parts[-1].startswith("ln"):
        return "norms"
    if _MLP & set(parts):
        return "mlp"
    return "other"


def module_roles(model: nn.Module) -> dict[str, str]:
    """Role of every named module ("" is the root)."""
    names = dict(model.named_modules())
    blocks = moe_blocks(set(names))
    return {name: role_of(name, module, blocks) for name, module in names.items()}


# -- groups that must share a format ----------------------------------------------------------------
def _alt(*names: str) -> str:
    return "|".join(re.escape(n) for n in names)


_EXPERT_RE = re.compile(rf"^(?P<layer>.*\.{re.escape(_D.mlp)})\.{re.escape(_D.experts)}\.\d+\.(?P<proj>\w+)$")
_QKV_RE = re.compile(rf"^(?P<attn>.*\.{re.escape(_D.attention)})\.(?:{_alt(*_D.qkv)})$")
_GATE_UP_RE = re.compile(rf"^(?P<mlp>.*\.(?:{_alt(_D.mlp, _D.shared_expert)}))\.(?:{_alt(*_D.gate_up)})$")
# Routers decide which expert runs: quantizing them moves tokens, not just values (fnmatch globs).
ROUTER_PATTERNS = [f"*.{_D.mlp}.{_D.router}", f"*{_D.shared_expert_gate}"]


def format_group(name: str, whole_experts: bool = False) -> str:
    """The format group of a linear: ``<attn>.qkv``, ``<mlp>.gate_up`` (dense or shared expert),
    ``<mlp>.experts.gate_up`` / ``<mlp>.experts.down_proj`` (all experts of a layer), else itself.
    ``whole_experts``: a layer's experts are one group, ``<mlp>.experts`` (the fuse stage groups a MoE's
    experts only where gate/up and down share a format)."""
    if match := _EXPERT_RE.match(name):
        if whole_experts:
            return f"{match['layer']}.{_D.experts}"
        proj = _D.gate_up_group if match["proj"] in _D.gate_up else match["proj"]
        return f"{match['layer']}.{_D.experts}.{proj}"
    if match := _QKV_RE.match(name):
        return f"{match['attn']}.{_D.qkv_group}"
    if match := _GATE_UP_RE.match(name):  # a dense or shared-expert SwiGLU: gate and up read one input
        return f"{match['mlp']}.{_D.gate_up_group}"
    return name


# -- families ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One supported family: the names it goes by and the switches its config may leave out."""

    name: str  # ModelConfig.family
    hf_architecture: str  # config.json "architectures"
    model_type: str  # config.json "model_type"
    gguf_arch: str | None  # GGUF general.architecture (several families may share one: see family_for_gguf)
    # MoE config style: "" dense; "mixtral": num_local_experts, experts sized intermediate_size, every
    # layer sparse; "qwen": num_experts, moe_intermediate_size, decoder_sparse_step / mlp_only_layers.
    moe: str = ""
    shared_expert: bool = False  # reads shared_expert_intermediate_size (an always-on, sigmoid-gated expert)
    qk_norm: bool = False  # per-head RMSNorm on q and k
    # q/k/v bias: read from this config key (None: fixed), defaulting to qkv_bias; o_proj likewise.
    qkv_bias_key: str | None = "attention_bias"
    qkv_bias: bool = False
    o_bias_key: str | None = "attention_bias"
    sliding_window_key: bool = False  # a set "sliding_window" is used (no use_sliding_window flag), read as such
    gguf_norm_topk: bool = True  # llama.cpp's default for expert_weights_norm on this architecture
    gguf_permuted_qk: bool = False  # convert_hf_to_gguf permutes q/k rows (llama arch: interleaved RoPE)
    sliding_pattern: int = 0  # without layer_types: every Nth layer global, the others local (gemma3: 6)
    tied: bool = False  # tie_word_embeddings when config.json leaves it out
    # gemma3: (1 + weight) RMSNorms, sandwich norms, sqrt(hidden)-scaled embeddings, query_pre_attn_scalar.
    gemma: bool = False


FAMILY_TABLE: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "llama", "llama", gguf_permuted_qk=True),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", "qwen2", qkv_bias_key=None, qkv_bias=True, o_bias_key=None),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", "qwen3", qk_norm=True),
    Family("mixtral", "MixtralForCausalLM", "mixtral", "llama", moe="mixtral", sliding_window_key=True,
           gguf_permuted_qk=True),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", "qwen2moe", moe="qwen", shared_expert=True,
           qkv_bias_key="qkv_bias", qkv_bias=True, o_bias_key=None, gguf_norm_topk=False),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", moe="qwen", qk_norm=True),
    # Llama plus a sliding window; llama.cpp files Mistral GGUFs under "llama" (no window): they load as llama.
    Family("mistral", "MistralForCausalLM", "mistral", None, qkv_bias_key=None, o_bias_key=None,
           sliding_window_key=True),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", None, qk_norm=True, sliding_window_key=True,
           sliding_pattern=6, tied=True, gemma=True),
)
_BY_NAME = {f.name: f for f in FAMILY_TABLE}
# HF model_type -> Opus family name; the family decides the defaults the config.json may omit.
FAMILIES: dict[str, str] = {f.model_type: f.name for f in FAMILY_TABLE}
MOE_FAMILIES = tuple(f.name for f in FAMILY_TABLE if f.moe)
# GGUF architecture -> the family of a file without experts (dense rows last, so they win the key).
GGUF_ARCHES: dict[str, str] = {f.gguf_arch: f.name for f in sorted(FAMILY_TABLE, key=lambda f: bool(f.moe),
                                                                   reverse=True) if f.gguf_arch}


def family(name: str) -> Family:
    """The settings of family ``name`` (a ModelConfig.family)."""
    return _BY_NAME[name]


def family_for_model_type(model_type: object) -> Family | None:
    return next((f for f in FAMILY_TABLE if f.model_type == model_type), None)


def family_for_architecture(architecture: object) -> Family | None:
    return next((f for f in FAMILY_TABLE if f.hf_architecture == architecture), None)


def family_for_gguf(arch: str, moe: bool) -> Family | None:
    """The family of a GGUF architecture; llama.cpp files Mixtral under "llama", so experts decide."""
    found = [f for f in FAMILY_TABLE if f.gguf_arch == arch]
    return next((f for f in found if bool(f.moe) == moe), found[0] if found else None)
