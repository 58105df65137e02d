"""The profiler on tiny models: roles, a time partition that adds up, weights, ops, the generic path.

Shares and times are checked for consistency (they add up, they are non-negative), never against a
speed: timings on a shared machine are noise.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from opus.kv.cache import GrowingKVCache
from opus.models import DecoderLM, ModelConfig
from opus.report.plots import profile_shares
from opus.runtime.metrics import MB, model_mb
from opus.runtime.profiling import ROLES, ProfileWorkload, module_roles, profile_metrics, profile_model, summary_line

WORKLOAD = ProfileWorkload(batch_size=2, input_len=8, output_len=4, warmup=0, repeats=1)


def tiny_lm(experts: int = 4, tied: bool = False, shared: int = 0, family: str = "mixtral") -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(family=family, vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, num_experts=experts, top_k=2 if experts else 0,
                      moe_intermediate_size=24 if experts else 0, shared_expert_intermediate_size=shared,
                      tie_word_embeddings=tied)
    return DecoderLM(cfg).eval()


@pytest.fixture(scope="module")
def moe() -> DecoderLM:
    return tiny_lm()


@pytest.fixture(scope="module")
def moe_profile(moe: DecoderLM) -> dict:
    return profile_model(moe, WORKLOAD, max_modules=10_000)


def test_roles_follow_module_names() -> None:
    roles = module_roles(tiny_lm(shared=16, family="qwen2_moe"))
    expected = {
        "model.embed_tokens": "embedding", "lm_head": "lm_head", "model.norm": "norms",
        "model.layers.0.input_layernorm": "norms", "model.layers.0.self_attn": "attention",
        "model.layers.0.self_attn.q_proj": "attention", "model.rotary_emb": "attention",
        "model.layers.0.mlp": "router", "model.layers.0.mlp.gate": "router",
        "model.layers.0.mlp.shared_expert_gate": "router", "model.layers.0.mlp.experts.3.down_proj": "experts",
        "model.layers.0.mlp.shared_expert.up_proj": "experts", "model.layers.1": "other", "": "other",
    }
    assert {name: roles[name] for name in expected} == expected
    dense = module_roles(tiny_lm(experts=0, family="llama"))
    assert dense["model.layers.1.mlp"] == dense["model.layers.1.mlp.gate_proj"] == "mlp"


def test_groups_partition_the_time(moe_profile: dict) -> None:
    groups = moe_profile["groups"]
    assert set(groups) == set(ROLES)
    assert math.isclose(sum(g["share"] for g in groups.values()), 1.0, abs_tol=1e-3)
    assert groups["experts"]["share"] > 0 and groups["attention"]["share"] > 0 and groups["router"]["share"] > 0
    assert groups["mlp"]["share"] == 0  # every layer is sparse: no dense MLP
    for phase in ("prefill", "decode"):
        section = moe_profile[phase]
        assert section["ms"] > 0
        assert math.isclose(sum(section["ms_by_role"].values()), section["ms"], rel_tol=1e-3)
        assert math.isclose(sum(section["shares"].values()), 1.0, abs_tol=1e-3)
    assert all(m["share"] >= 0 for m in moe_profile["modules"])
    assert math.isclose(sum(m["share"] for m in moe_profile["modules"]), 1.0, abs_tol=1e-3)


def test_weight_bytes_per_role_add_up_to_the_model(moe: DecoderLM, moe_profile: dict) -> None:
    total = round(model_mb(moe) * MB)
    assert sum(g["param_bytes"] for g in moe_profile["groups"].values()) == total == moe_profile["param_bytes"]
    expert_params = sum(p.numel() * 4 for n, p in moe.named_parameters() if ".experts." in n)
    assert moe_profile["groups"]["experts"]["param_bytes"] == expert_params


def test_tied_embedding_counts_once() -> None:
    model = tiny_lm(experts=0, tied=True, family="llama")
    profile = profile_model(model, WORKLOAD)
    assert sum(g["param_bytes"] for g in profile["groups"].values()) == round(model_mb(model) * MB)
    assert profile["groups"]["lm_head"]["param_bytes"] == 0  # the shared matrix belongs to the embedding
    assert profile["groups"]["mlp"]["share"] > 0 and profile["groups"]["experts"]["share"] == 0


def test_ops_and_activations(moe_profile: dict) -> None:
    b, t, hidden = WORKLOAD.batch_size, WORKLOAD.input_len, 32
    for phase in ("prefill", "decode"):
        assert moe_profile["ops"][phase] > 0
        # Every dispatched op is attributed to exactly one module, so the roles' counts add up.
        assert sum(g["ops"][phase] for g in moe_profile["groups"].values()) == moe_profile["ops"][phase]
        assert moe_profile["groups"]["experts"]["ops"][phase] > 0
    emb = moe_profile["groups"]["embedding"]["act_bytes"]
    assert emb == {"prefill": b * t * hidden * 4, "decode": b * 1 * hidden * 4}
    lm_head = moe_profile["groups"]["lm_head"]["act_bytes"]["decode"]
    assert lm_head == b * 61 * 4  # last_only: one position of logits per row


def test_metrics_and_summary(moe_profile: dict) -> None:
    metrics = profile_metrics(moe_profile)
    assert {f"share_{r}" for r in ROLES} <= set(metrics)
    assert metrics["profile_prefill_ms"] > 0 and metrics["profile_decode_ms"] > 0
    assert metrics["profile_ops_prefill"] > 0 and metrics["profile_ops_decode"] > 0
    assert "experts" in summary_line(moe_profile) and " %" in summary_line(moe_profile)
    top = moe_profile["hotspots"]
    assert 0 < len(top) <= 10 and top == sorted(top, key=lambda m: -m["share"])
    assert profile_shares(moe_profile).startswith(b"\x89PNG")


def test_hooks_are_removed_and_the_cache_is_the_given_one(moe: DecoderLM) -> None:
    caches: list[GrowingKVCache] = []

    def factory(batch: int, max_len: int) -> GrowingKVCache:
        caches.append(GrowingKVCache(2))
        return caches[-1]

    profile_model(moe, WORKLOAD, factory)
    # One cache per run (timed plain, timed hooked, counted), each holding prompt + decoded token.
    assert len(caches) == 3 and all(c.seq_len == WORKLOAD.input_len + 1 for c in caches)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in moe.modules())


def test_a_failing_forward_leaves_no_hooks() -> None:
    model = tiny_lm(experts=0, family="llama")

    def boom(module: nn.Module, args: tuple) -> None:
        raise RuntimeError("boom")

    handle = model.model.norm.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        profile_model(model, WORKLOAD)
    handle.remove()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class Generic(nn.Module):
    """Not an Opus LM: no cache interface, its own names."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.ln_f = nn.LayerNorm(16)
        self.ffn = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.proj = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 50)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids)
        h = h + self.ffn(self.ln_f(h))
        return self.lm_head(self.proj(h))


def test_generic_module_gets_a_prefill_profile() -> None:
    model = Generic().eval()
    profile = profile_model(model, WORKLOAD)
    assert profile["decode"] is None and profile["notes"]
    groups = profile["groups"]
    for role in ("embedding", "norms", "mlp", "lm_head", "other"):
        assert groups[role]["share"] > 0, role
    assert math.isclose(sum(g["share"] for g in groups.values()), 1.0, abs_tol=1e-3)
    assert sum(g["param_bytes"] for g in groups.values()) == round(model_mb(model) * MB)
    metrics = profile_metrics(profile)
    assert "profile_prefill_ms" in metrics and "profile_decode_ms" not in metrics
    assert profile_shares(profile).startswith(b"\x89PNG")


def test_model_without_token_ids_is_refused() -> None:
    with pytest.raises(ValueError, match="input_ids"):
        profile_model(nn.Sequential(nn.Linear(4, 4)), WORKLOAD)
