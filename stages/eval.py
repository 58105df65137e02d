"""Measure the incoming (possibly optimized) model like the baseline, plus its fidelity to it.

Fidelity compares against the reference the upstream baseline stage saved: ``agreement``
(teacher-forced greedy token agreement), ``agreement_free`` (free-running, through the engine and
its KV cache), ``logits_cosine`` and ``top5_overlap``. Keep this stage's measurement switches the
same as the baseline's so the ratios compare like with like.
"""

from __future__ import annotations

from opus.pipeline.context import StageContext, StageResult
from stages import FIDELITY_METRICS, REFERENCE, SUITE_METRICS, MeasureConfig, measure_incoming

VERSION = "1"
ROLE = "eval"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = SUITE_METRICS | FIDELITY_METRICS  # what a gate on this stage can name


class Config(MeasureConfig):
    fidelity: bool = True  # compare with the upstream baseline's reference


def run(ctx: StageContext, cfg: Config) -> StageResult:
    from opus.runtime.metrics import Reference, compare_to_reference, fidelity_units

    reference, baseline = None, None
    if cfg.fidelity:
        baseline = next((up for up in ctx.upstream.values() if up.baseline), None)
        if baseline is None:
            ctx.log("no baseline stage upstream (add one to `needs`): fidelity metrics skipped")
        elif not baseline.artifact(REFERENCE).is_file():
            ctx.log(f"baseline stage '{baseline.id}' left no {REFERENCE}: fidelity metrics skipped")
        else:
            reference = Reference.load(baseline.artifact(REFERENCE))
    extra = fidelity_units(reference.tokens.shape[1]) if reference is not None else 0
    measured = measure_incoming(ctx, cfg, extra_units=extra)
    if reference is not None and baseline is not None:
        measured.metrics.update(compare_to_reference(measured.loaded.model, reference, measured.factory,
                                                     measured.progress))
        measured.info["fidelity_reference"] = str(baseline.artifact(REFERENCE))
    return StageResult(metrics=measured.metrics, info=measured.info)
