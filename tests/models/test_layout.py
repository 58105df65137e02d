"""The one layout table: every module of a dense and an MoE decoder gets a role, profiling and quant
grouping agree on it, format and smoothing groups keep their published names, every family loads.

Group and role names are written into plans, profile.json and checkpoints: the literal names below
pin them, so a table edit that would rename one fails here rather than in a published run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from opus_model_kit import COMMON, FAMILY_CASES, GGUF_ARCH
from torch import nn

from opus.models import DecoderLM, ModelConfig, config_from_hf
from opus.models.gguf_file import ARCHES, config_from_gguf
from opus.models.layout import (
    DECODER,
    FAMILIES,
    FAMILY_TABLE,
    GGUF_ARCHES,
    ROLES,
    ROUTER_PATTERNS,
    family,
    family_for_architecture,
    family_for_gguf,
    format_group,
    module_roles,
    role_of,
)
from opus.quant.groups import build_groups
from opus.quant.smooth import smooth_groups
from opus.runtime import profiling


def tiny(family_name: str, experts: int = 0, shared: int = 0, moe_layers: list[bool] | None = None,
         **kw: Any) -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(family=family_name, vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=4, num_experts=experts, top_k=2 if experts else 0,
                      moe_intermediate_size=12 if experts else 0, shared_expert_intermediate_size=shared,
                      moe_layers=moe_layers or [], **kw)
    return DecoderLM(cfg).eval()


DENSE = ("qwen3", {"qk_norm": True})
MOE = ("qwen2_moe", {"experts": 3, "shared": 8, "moe_layers": [True, False]})  # layer 1 is a dense MLP


def _dense() -> DecoderLM:
    return tiny(DENSE[0], **DENSE[1])


def _moe() -> DecoderLM:
    return tiny(MOE[0], **MOE[1])


# -- roles ------------------------------------------------------------------------------------------
def test_the_table_names_real_modules() -> None:
    model = _moe()
    d = DECODER
    paths = [d.embedding, d.final_norm, d.rotary, d.lm_head, f"{d.layer(0)}.{d.input_norm}",
             f"{d.layer(0)}.{d.post_attention_norm}", f"{d.mlp_of(0)}.{d.router}",
             f"{d.mlp_of(0)}.{d.shared_expert_gate}", f"{d.mlp_of(0)}.{d.shared_expert}",
             *(f"{d.attention_of(1)}.{n}" for n in (*d.qkv, d.o_proj)),
             *(f"{d.mlp_of(0)}.{d.experts}.2.{n}" for n in d.swiglu), *(f"{d.mlp_of(1)}.{n}" for n in d.swiglu)]
    for path in paths:
        model.get_submodule(path)  # raises if the table and the decoder disagree
    dense = _dense()
    for path in (f"{d.attention_of(0)}.{d.q_norm}", f"{d.attention_of(0)}.{d.k_norm}"):
        dense.get_submodule(path)


@pytest.mark.parametrize("build", [_dense, _moe], ids=["dense", "moe"])
def test_every_module_gets_a_role(build) -> None:
    model = build()
    roles = module_roles(model)
    assert set(roles) == {n for n, _ in model.named_modules()} and set(roles.values()) <= set(ROLES)
    # Only the containers are "other": every module that computes something has a real role.
    assert sorted(n for n, r in roles.items() if r == "other") == ["", "model", "model.layers", "model.layers.0",
                                                                  "model.layers.1"]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name.rpartition(".")[2]
            want = ("lm_head" if name == "lm_head" else "experts" if ".experts." in name or ".shared_expert." in name
                    else "router" if last in ("gate", "shared_expert_gate") else "attention" if ".self_attn." in name
                    else "mlp")
            assert roles[name] == want, name


def test_moe_roles_by_name() -> None:
    roles = module_roles(_moe())
    expected = {
        "model.embed_tokens": "embedding", "lm_head": "lm_head", "model.norm": "norms", "model.rotary_emb": "attention",
        "model.layers.0.input_layernorm": "norms", "model.layers.0.post_attention_layernorm": "norms",
        "model.layers.0.self_attn": "attention", "model.layers.0.self_attn.o_proj": "attention",
        "model.layers.0.mlp": "router", "model.layers.0.mlp.gate": "router",
        "model.layers.0.mlp.shared_expert_gate": "router", "model.layers.0.mlp.experts": "experts",
        "model.layers.0.mlp.experts.1.gate_proj": "experts", "model.layers.0.mlp.shared_expert.down_proj": "experts",
        "model.layers.1.mlp": "mlp", "model.layers.1.mlp.up_proj": "mlp",
    }
    assert {n: roles[n] for n in expected} == expected


@pytest.mark.parametrize("build", [_dense, _moe], ids=["dense", "moe"])
def test_profiling_and_quant_grouping_agree_on_roles(build) -> None:
    model = build()
    assert profiling.ROLES == ROLES
    profiled = profiling.module_roles(model)
    groups = build_groups(model, [], [], tied=True)
    assert groups
    for group in groups:
        assert {profiled[m] for m in group.modules} == {group.role}, group.name
        # Without the model, the name alone gives the same role (the decoder's own spelling).
        assert {role_of(m) for m in group.modules} == {group.role}, group.name


# -- groups that share a format ---------------------------------------------------------------------
def test_format_groups_keep_their_names() -> None:
    groups = {g.name: (g.role, g.modules) for g in build_groups(_moe(), [], [])}
    a, e, m = "model.layers.0.self_attn", "model.layers.0.mlp.experts", "model.layers.1.mlp"
    assert groups == {
        f"{a}.qkv": ("attention", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]),
        f"{a}.o_proj": ("attention", [f"{a}.o_proj"]),
        "model.layers.0.mlp.gate": ("router", ["model.layers.0.mlp.gate"]),
        f"{e}.gate_up": ("experts", [f"{e}.{i}.{p}" for i in range(3) for p in ("gate_proj", "up_proj")]),
        f"{e}.down_proj": ("experts", [f"{e}.{i}.down_proj" for i in range(3)]),
        "model.layers.0.mlp.shared_expert.gate_up": ("experts", ["model.layers.0.mlp.shared_expert.gate_proj",
                                                                 "model.layers.0.mlp.shared_expert.up_proj"]),
        "model.layers.0.mlp.shared_expert.down_proj": ("experts", ["model.layers.0.mlp.shared_expert.down_proj"]),
        "model.layers.0.mlp.shared_expert_gate": ("router", ["model.layers.0.mlp.shared_expert_gate"]),
        "model.layers.1.self_attn.qkv": ("attention", [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]),
        "model.layers.1.self_attn.o_proj": ("attention", ["model.layers.1.self_attn.o_proj"]),
        f"{m}.gate_up": ("mlp", [f"{m}.gate_proj", f"{m}.up_proj"]),
        f"{m}.down_proj": ("mlp", [f"{m}.down_proj"]),
        "lm_head": ("lm_head", ["lm_head"]),
    }
    assert ROUTER_PATTERNS == ["*.mlp.gate", "*shared_expert_gate"]  # stages/plan.py's force default spells these
    assert format_group("blocks.3.mlp.experts.7.up_proj") == "blocks.3.mlp.experts.gate_up"  # any prefix


def test_smoothing_groups_keep_their_paths() -> None:
    got = [(g.source, g.kind, g.targets) for g in smooth_groups(_moe())]
    p, a, x = "model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp"
    experts = [f"{x}.experts.{i}" for i in range(3)] + [f"{x}.shared_expert"]
    assert got[:2 + len(experts) + 1] == [
        (f"{p}.input_layernorm", "norm", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]),
        (f"{a}.v_proj", "v_to_o", [f"{a}.o_proj"]),
        *((f"{e}.up_proj", "rows", [f"{e}.down_proj"]) for e in experts),
        (f"{p}.post_attention_layernorm", "norm",
         [f"{x}.gate", f"{x}.shared_expert_gate", *(f"{e}.{n}" for e in experts for n in ("gate_proj", "up_proj"))]),
    ]
    q, b, y = "model.layers.1", "model.layers.1.self_attn", "model.layers.1.mlp"
    assert got[2 + len(experts) + 1:] == [
        (f"{q}.input_layernorm", "norm", [f"{b}.q_proj", f"{b}.k_proj", f"{b}.v_proj"]),
        (f"{b}.v_proj", "v_to_o", [f"{b}.o_proj"]),
        (f"{y}.up_proj", "rows", [f"{y}.down_proj"]),
        (f"{q}.post_attention_layernorm", "norm", [f"{y}.gate_proj", f"{y}.up_proj"]),
    ]
    assert smooth_groups(nn.Linear(2, 2)) == []


# -- families ---------------------------------------------------------------------------------------
def test_the_family_table_is_the_one_the_loaders_read() -> None:
    from opus.models import config

    assert config.FAMILIES is FAMILIES and ARCHES is GGUF_ARCHES
    assert config.MOE_FAMILIES == tuple(f.name for f in FAMILY_TABLE if f.moe)
    assert len({f.name for f in FAMILY_TABLE}) == len({f.model_type for f in FAMILY_TABLE}) == len(FAMILY_TABLE)
    # Every family has a transformers reference case in the test kit: adding one means adding its case.
    assert {f.name for f in FAMILY_TABLE} == set(FAMILY_CASES)


@pytest.mark.parametrize("fam", FAMILY_TABLE, ids=lambda f: f.name)
def test_each_family_loads_from_an_hf_config(fam) -> None:
    cfg_cls, model_cls, extra = FAMILY_CASES[fam.name]
    hf = {**cfg_cls(**{**COMMON, **extra}).to_dict(), "architectures": [model_cls.__name__]}
    assert hf["model_type"] == fam.model_type and family_for_architecture(model_cls.__name__) is fam
    cfg = config_from_hf(hf)
    assert cfg.family == fam.name and family(cfg.family) is fam
    assert cfg.qk_norm == fam.qk_norm and bool(cfg.num_experts) == bool(fam.moe)
    assert bool(cfg.shared_expert_intermediate_size) == fam.shared_expert
    DecoderLM(cfg)  # and the config builds the one decoder


def _gguf_metadata(fam, experts: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    arch = fam.gguf_arch
    meta: dict[str, Any] = {"general.architecture": arch, f"{arch}.embedding_length": 16,
                            f"{arch}.block_count": 2, f"{arch}.attention.head_count": 4,
                            f"{arch}.attention.head_count_kv": 2, f"{arch}.context_length": 64,
                            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.feed_forward_length": 24,
                            f"{arch}.vocab_size": 40}
    raw = {"token_embd.weight": torch.zeros(40, 16)}
    if fam.qk_norm:
        raw["blk.0.attn_q_norm.weight"] = torch.zeros(4)
    if experts:
        meta.update({f"{arch}.expert_count": experts, f"{arch}.expert_used_count": 2})
        for i in range(2):
            raw[f"blk.{i}.ffn_gate_inp.weight"] = torch.zeros(experts, 16)
            raw[f"blk.{i}.ffn_gate_exps.weight"] = torch.zeros(experts, 12, 16)
            if fam.shared_expert:
                raw[f"blk.{i}.ffn_gate_shexp.weight"] = torch.zeros(8, 16)
    return meta, raw


@pytest.mark.parametrize("fam", [f for f in FAMILY_TABLE if f.gguf_arch], ids=lambda f: f.name)
def test_each_family_loads_from_gguf_metadata(fam) -> None:
    assert GGUF_ARCH[fam.name] == fam.gguf_arch  # what the kit's writer (llama.cpp's converter) files it under
    meta, raw = _gguf_metadata(fam, experts=3 if fam.moe else 0)
    cfg = config_from_gguf(meta, raw, "m.gguf")
    assert cfg.family == fam.name and family_for_gguf(fam.gguf_arch, bool(fam.moe)) is fam
    assert cfg.qk_norm == fam.qk_norm and cfg.num_experts == (3 if fam.moe else 0)
    assert cfg.norm_topk_prob == fam.gguf_norm_topk
    assert bool(cfg.shared_expert_intermediate_size) == fam.shared_expert
    DecoderLM(cfg)
