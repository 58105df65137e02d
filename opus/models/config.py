"""The one config every Opus decoder is built from, derived from a Hugging Face ``config.json``.

Families differ in a handful of switches (qkv bias, q/k RMSNorm, MoE routing, a shared expert),
so one dataclass plus one decoder file replaces five near-copies of the same model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opus.atomic import not_a_regular_file
from opus.errors import EXIT_INVALID, OpusError
from opus.models import layout


class ModelLoadError(OpusError):
    """A model could not be built or loaded; the message is one line and names the culprit."""

    exit_code = EXIT_INVALID


def require_regular_file(path: Path, listed: str = "") -> None:
    """A ModelLoadError unless ``path`` is a regular file (a FIFO would block the first read forever)."""
    if problem := not_a_regular_file(path):
        raise ModelLoadError(f"{'missing file' if problem == 'missing' else problem}: {path}{listed}")


# config.json's hidden_act / hidden_activation -> ModelConfig.hidden_act.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# HF model_type -> Opus family, and the MoE families: both derived from the one family table.
FAMILIES: dict[str, str] = layout.FAMILIES
MOE_FAMILIES = layout.MOE_FAMILIES


@dataclass
class ModelConfig:
    """Hyperparameters of an Opus decoder-only LM (plain data: safe to JSON-dump into a recipe)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (qwen2, qwen2_moe; llama attention_bias)
    o_bias: bool = False  # bias on o_proj (llama/qwen3 attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3, qwen3_moe)
    num_experts: int = 0  # 0 = dense
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights (always true for mixtral)
    shared_expert_intermediate_size: int = 0  # qwen2_moe: an always-on expert with a sigmoid gate
    # Per layer: True where the MLP is the sparse MoE block (qwen-moe decoder_sparse_step/mlp_only_layers).
    moe_layers: list[bool] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # mistral / mixtral: attention sees at most this many keys. Within it, sliding-window attention is
    # full attention, so Opus runs only contexts that fit (opus.models.decoder.window_guard refuses longer).
    sliding_window: int | None = None
    # Per layer: True where attention is local (the window, RoPE base rope_local_theta); gemma3 alternates
    # local and global layers. Empty: every layer when sliding_window is set.
    sliding_layers: list[bool] = field(default_factory=list)
    rope_local_theta: float | None = None  # None: rope_theta
    # gemma3: RMSNorm scales by (1 + weight); a norm on the attention and MLP outputs too (sandwich);
    # embeddings times sqrt(hidden_size); softmax scale query_pre_attn_scalar ** -0.5.
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh"

    def __post_init__(self) -> None:
        if self.num_experts and not self.moe_layers:
            self.moe_layers = [True] * self.num_layers
        if not self.num_experts:
            self.moe_layers = [False] * self.num_layers
        if not self.sliding_layers:
            self.sliding_layers = [self.sliding_window is not None] * self.num_layers
        if self.hidden_act not in ACTIVATIONS.values():
            raise ModelLoadError(f"hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"top_k ({self.top_k}) must be in 1..num_experts ({self.num_experts})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_theta(cfg: dict[str, Any]) -> float:
    """rope_theta from either the 5.x ``rope_parameters`` or the 4.x top-level keys.

    Only the default RoPE is implemented: a scaled variant would silently change every logit.
    """
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # 5.x, one entry per layer type (gemma3)
        params = params["full_attention"] or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ModelLoadError(f"rope type {kind!r} is not supported (only the default RoPE is implemented)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _local_rope_theta(cfg: dict[str, Any]) -> float | None:
    """The RoPE base of local (sliding-window) layers where it differs: 5.x ``rope_parameters`` by layer
    type, 4.x ``rope_local_base_freq`` (gemma3)."""
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict):
        if (local.get("rope_type") or "default") != "default":
            raise ModelLoadError(f"rope type {local['rope_type']!r} of the sliding layers is not supported")
        return float(local.get("rope_theta", 10000.0))
    found = cfg.get("rope_local_base_freq")
    return float(found) if found is not None else None


def _sliding_layers(cfg: dict[str, Any], fam: layout.Family, layers: int) -> list[bool]:
    """Which layers attend locally: ``layer_types``, else the family's every-Nth-layer-global pattern,
    else every layer once a window is set."""
    types = cfg.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or fam.sliding_pattern)
    if pattern:
        return [(i + 1) % pattern != 0 for i in range(layers)]
    return [bool(cfg.get("sliding_window"))] * layers


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face config.json (as a dict) into a ModelConfig."""
    model_type = cfg.get("model_type")
    fam = layout.family_for_model_type(model_type)
    if fam is None:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    family = fam.name
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if cfg.get("use_sliding_window") or (not fam.sliding_window_key
                                         and "sliding_attention" in (cfg.get("layer_types") or [])):
        raise ModelLoadError("sliding-window attention is not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelLoadError(f"{key} ({cfg[key]}) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional attention is not supported (a causal LM only)")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    # Bias switches: a family reads them from its own config key, or fixes them (qwen2: q/k/v only).
    qkv_bias = bool(cfg.get(fam.qkv_bias_key, fam.qkv_bias)) if fam.qkv_bias_key else fam.qkv_bias
    o_bias = bool(cfg.get(fam.o_bias_key, False)) if fam.o_bias_key else False
    kw: dict[str, Any] = dict(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tied)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=fam.qk_norm,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        sliding_window=int(cfg["sliding_window"]) if fam.sliding_window_key and cfg.get("sliding_window") else None,
        hidden_act=ACTIVATIONS[act],
    )
    if kw["sliding_window"]:
        kw["sliding_layers"] = _sliding_layers(cfg, fam, layers)
        if len(kw["sliding_layers"]) != layers:
            raise ModelLoadError(f"layer_types has {len(kw['sliding_layers'])} entries for {layers} layers")
        local = _local_rope_theta(cfg)
        kw["rope_local_theta"] = local if local is not None and local != kw["rope_theta"] else None
    if fam.gemma:
        scalar = cfg.get("query_pre_attn_scalar")
        kw.update(norm_offset=True, sandwich_norms=True, embed_scale=True,
                  attn_scale=float(scalar) ** -0.5 if scalar else None)
    if fam.moe == "mixtral":
        kw.update(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                  moe_intermediate_size=kw["intermediate_size"], norm_topk_prob=True)
    if fam.moe == "qwen":
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        kw.update(
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if fam.shared_expert else 0,
            moe_layers=[experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(layers)],
        )
    return ModelConfig(**kw)


def hf_config(cfg: ModelConfig) -> dict[str, Any] | None:
    """A Hugging Face config.json (as a dict) that ``config_from_hf`` reads back to ``cfg`` exactly, or None
    when the family's config keys cannot say it (e.g. a GGUF file whose biases no HF key of its family names).

    What a GGUF source's export writes as its config.json (opus.export.native).
    """
    fam = layout.family(cfg.family)
    raw: dict[str, Any] = {
        "architectures": [fam.hf_architecture], "model_type": fam.model_type, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings, "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
    }
    if fam.qkv_bias_key:
        raw[fam.qkv_bias_key] = cfg.qkv_bias
    if fam.o_bias_key:
        raw[fam.o_bias_key] = raw.get(fam.o_bias_key, False) or cfg.o_bias  # one key for both: read back below
    if fam.moe == "mixtral":
        raw.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                   intermediate_size=cfg.moe_intermediate_size)
    if fam.moe == "qwen":
        raw.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[i for i, sparse in enumerate(cfg.moe_layers) if not sparse])
        if fam.shared_expert:
            raw["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    try:
        return raw if config_from_hf(raw) == cfg else None
    except (ModelLoadError, KeyError, TypeError, ValueError):
        return None
