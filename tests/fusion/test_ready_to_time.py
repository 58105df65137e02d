"""A model readied as the fuse and kv_config stages run it (opus.fusion.ready_to_time): fused, quantized experts
compiled at prefill, decode steps compiled in the static cache; and it still computes the same tokens."""

from __future__ import annotations

import pytest
import torch
from fusion_kit import prompts, tiny_lm

from opus.fusion.moe import grouped_moes
from opus.fusion.ready_to_time import fused_and_compiled
from opus.kv.static import CompiledStaticKVCache
from opus.quant.apply import quantize_model
from opus.quant.calibrate import collect_stats
from opus.runtime.engine import generate

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@torch.no_grad()
def test_a_w8a8_moe_is_fused_its_experts_compiled_at_prefill_and_its_steps_compiled() -> None:
    model = tiny_lm("mixtral")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith(".gate")]
    quantize_model(model, dict.fromkeys(names, "w8a8"), collect_stats(model, prompts()), group_size=32)
    ids = prompts(2, 12)
    expected = generate(model, ids, 4).tokens
    fused, factory = fused_and_compiled(model, ids)
    moes = grouped_moes(fused)
    assert moes and all(moe.modes["prefill"] == "compiled" for _, moe in moes)
    assert isinstance(factory(2, 16), CompiledStaticKVCache)
    assert torch.equal(generate(fused, ids, 4, factory).tokens, expected)
