"""Operator fusion by torch.fx graph rewrites, per region, each rewrite checked and recorded.

Public surface::

    fuse_model(model, FusionConfig(...), probe) -> FusionOutcome   # decide + rewrite (in place)
    outcome.step(compile_settings) -> {"kind": "fuse", ...}         # the recipe step
    apply_fusion(model, step) -> model                              # replay on load (registered "fuse")
    lm_probe(input_ids) / call_probe(*inputs)                       # how fuse_model runs the model
    lm_reference / generic_reference / compare                      # equivalence before vs after
    lm_op_counts / region_nodes / decode_step_s / trivial_op_s      # the fusion report's counts
    decide_compile(model, input_ids, settings)                      # optional torch.compile, measured
    replay_compile(model, record, settings, source)                 # or an earlier run's choice
    register_concat(cls) / register_stacker(cls)                    # quantized linears plug in here
"""

from opus.fusion.capture import call_probe, lm_probe
from opus.fusion.compiled import CompileDecision, decide_compile, replay_compile
from opus.fusion.equivalence import Reference, compare, generic_reference, lm_reference
from opus.fusion.linear_ops import StackedLinear, register_concat, register_stacker
from opus.fusion.measure import decode_step_s, dispatch_share, lm_op_counts, region_nodes, trivial_op_s
from opus.fusion.moe import GroupedMoE
from opus.fusion.patterns import PATTERNS
from opus.fusion.rewrite import FusionConfig, FusionOutcome, apply_fusion, fuse_model

__all__ = [
    "PATTERNS",
    "CompileDecision",
    "FusionConfig",
    "FusionOutcome",
    "GroupedMoE",
    "Reference",
    "StackedLinear",
    "apply_fusion",
    "call_probe",
    "compare",
    "decide_compile",
    "decode_step_s",
    "dispatch_share",
    "fuse_model",
    "generic_reference",
    "lm_op_counts",
    "lm_probe",
    "lm_reference",
    "region_nodes",
    "replay_compile",
    "register_concat",
    "register_stacker",
    "trivial_op_s",
]
