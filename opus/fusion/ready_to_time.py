"""A model made ready to run as the fuse and kv_config stages can run it, for checks that time whole
models before those stages (the plan stage's end-to-end check, opus.quant.validate): fused with every
pattern, a MoE's experts in the ``compiled`` mode at prefill where they have it, and decode steps
compiled in the static KV cache; the prefill compiled too where the pipeline's kv_config may keep that.
The runtime changes the ranking: on K3 (Intel Xeon, AMX), timed eagerly and unfused, the plan's float
experts beat uniform W8A8 (2,546 against 2,657 ms a batch of the demo workload); fused and compiled,
uniform W8A8 won (1,334 against 1,507 ms). With only the decode steps compiled, the eager prefill's W8A8
(its activations quantized in several passes) hid most of that: on 2026-12-06 the two tied within a noisy
machine's margin (2,072 and 2,113 ms), the plan kept its float experts, and the eval's P was ×2.46 where
uniform W8A8 reached ×3.3; with the prefill compiled too, uniform W8A8 won by 1,197 against 1,496 ms
(torch's SDPA at prefill; 1,106 against 1,436 with Opus's blocked attention)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opus.fusion.capture import lm_probe
from opus.fusion.moe import grouped_moes
from opus.fusion.rewrite import FusionConfig, fuse_model
from opus.kv import static
from opus.kv.cache import cache_factory

PROBE_TOKENS = 32  # the fusion's equivalence probe: one prompt cut to this length


def fused_and_compiled(model: nn.Module, prompt: torch.Tensor, compile_prefill: bool = False
                       ) -> tuple[nn.Module, Any]:
    """(the fused model, a factory of static caches with compiled decode steps, and with the prefill
    compiled too when ``compile_prefill``); ``prompt [1, T]`` probes the fusion's equivalence. ``model``
    may be changed in place."""
    fused = fuse_model(model, FusionConfig(), lm_probe(prompt[:1, :PROBE_TOKENS])).model
    for _, moe in grouped_moes(fused):
        if moe.mode_reason("compiled") is None:
            moe.modes["prefill"] = "compiled"
    return fused, cache_factory(fused, static.cache_config(True, compile_prefill=compile_prefill))
