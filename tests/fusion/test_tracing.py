"""Tracing: torch.fx's registry of generated code that calls wrapped ops stays the size of what lives."""

from __future__ import annotations

import gc

import torch
from fusion_kit import prompts, tiny_lm
from torch.fx import _symbolic_trace

from opus.fusion import FusionConfig, fuse_model, lm_probe
from opus.fusion.tracing import release_dead_wrap_registrations, trace


def generated_registrations() -> int:
    """Entries of fx's table that belong to generated code (module globals carry a ``__name__``)."""
    return sum("__name__" not in g for g in _symbolic_trace._wrapped_fns_to_patch.values())


def wrapped_calls(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("is_wrapped")]


def test_dead_generated_code_is_released_and_live_code_still_retraces():
    fused = fuse_model(tiny_lm("llama"), FusionConfig(), lm_probe(prompts()[:1, :8])).model
    mlp = fused.model.layers[0].mlp
    assert isinstance(mlp, torch.fx.GraphModule) and "opus_fusion_ops_swiglu" in mlp.code
    gc.collect()  # traces thrown away in cycles: gone once collected
    release_dead_wrap_registrations()
    live = generated_registrations()
    assert live > 0  # the fused model's regions call wrapped ops: their code is registered

    for _ in range(3):  # fused and thrown away: each leaves registrations behind in fx's table
        fuse_model(tiny_lm("llama"), FusionConfig(), lm_probe(prompts()[:1, :8]))
    gc.collect()
    assert generated_registrations() > live
    assert release_dead_wrap_registrations() > 0
    # What the live model's code needs, and no more: at most what lived before (an earlier test's object
    # that died meanwhile, in the suite, takes its registrations with it: fewer, never more).
    assert generated_registrations() <= live
    live = generated_registrations()

    # The live region still retraces with the fused op kept as one call (its registration stayed).
    assert wrapped_calls(trace(mlp)) == ["swiglu"]
    del fused, mlp
    gc.collect()
    release_dead_wrap_registrations()
    assert generated_registrations() < live  # the model gone, its code's registrations go too
