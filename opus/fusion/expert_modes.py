"""Which execution mode the grouped MoE experts run in, per phase, chosen by measurement.

``decide_expert_modes`` takes a fused model (its ``GroupedMoE`` modules, ``opus.fusion.moe``), lists
the modes every one of them can run on the model's device (``sorted`` and ``dense`` everywhere,
``grouped`` where ``torch._grouped_mm`` runs for float experts, ``compiled`` on CPU for float and
W8A8 experts) and the others with the reason, checks
that each runnable mode computes what ``sorted`` computes, then times them with the shared rule of
``opus.runtime.timed_choice``: a prefill of the prompts, and a decode step at the decode batch. The winner
of each phase is set on every GroupedMoE and recorded (``ExpertChoice.record()`` in fusion.json, its
``modes`` in the fuse recipe step, the decisions in decisions.json), so resume and replay rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from opus.fusion.capture import tolerance_for
from opus.fusion.measure import decode_step_s
from opus.fusion.moe import DEFAULT_MODES, EXPERT_MODES, PHASES, grouped_moes, set_modes
from opus.runtime.data import tiled
from opus.runtime.timed_choice import (
    DEFAULT_ROUNDS,
    Decision,
    Option,
    decide,
    replayed,
    reported,
    run_relative,
    wall_clock,
)

# A tie within the noise goes to the simpler: the sorted mode (what ran before modes were chosen), then
# dense (plain GEMMs), then grouped (a private torch op), then compiled (an inductor compile per process).
SIMPLICITY = {"sorted": 0, "dense": 1, "grouped": 2, "compiled": 3}
WHAT = {"prefill": "MoE experts mode at prefill", "decode": "MoE experts mode at decode"}


@dataclass
class ExpertChoice:
    modes: dict[str, str]  # phase -> mode, set on every GroupedMoE
    runnable: list[str]
    unavailable: dict[str, str]  # mode -> why it cannot run (or was not measured) here
    decisions: list[Decision] = field(default_factory=list, repr=False)
    replayed_from: str | None = None

    def record(self) -> dict[str, Any]:
        """For fusion.json (what ``run.decisions_from`` replays)."""
        phases = {d.what: d for d in self.decisions}
        out: dict[str, Any] = {"modes": self.modes, "runnable": self.runnable, "unavailable": self.unavailable}
        for phase in PHASES:
            decision = phases.get(WHAT[phase])
            if decision is not None:
                out[phase] = {"winner": decision.winner, "reason": decision.reason,
                              "medians_ms": {k: round(v, 4) for k, v in decision.medians.items()},
                              "margin": round(decision.margin, 4)}
        return {**out, "replayed_from": self.replayed_from} if self.replayed_from else out


def availability(model: nn.Module, wanted: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(modes every GroupedMoE of ``model`` can run, {mode: why not} for the rest)."""
    runnable, unavailable = [], {}
    moes = grouped_moes(model)
    for mode in EXPERT_MODES:
        if wanted is not None and mode not in wanted:
            unavailable[mode] = "not in the fuse stage's experts.modes"
            continue
        why = next((f"{name}: {r}" for name, m in moes if (r := m.mode_reason(mode))), None)
        if why:
            unavailable[mode] = why
        else:
            runnable.append(mode)
    return runnable, unavailable


def _logits(model: nn.Module, ids: torch.Tensor, mode: str) -> torch.Tensor:
    set_modes(model, {"prefill": mode, "decode": mode})
    with torch.inference_mode():
        return model(ids).float()


def _differs(model: nn.Module, ids: torch.Tensor, modes: list[str], tolerance: float) -> dict[str, str]:
    """Modes whose logits on ``ids`` differ from the first mode's (the simplest) beyond ``tolerance``
    (relative max diff): a mode is a way to run the same experts, never a change of the model."""
    want = _logits(model, ids, modes[0])
    scale = float(want.abs().max()) or 1.0
    out = {}
    for mode in modes[1:]:
        diff = float((_logits(model, ids, mode) - want).abs().max()) / scale
        if not diff <= tolerance:
            out[mode] = f"outputs differ from the {modes[0]} mode: relative max diff {diff:.2e} > {tolerance:.0e}"
    return out


def decide_expert_modes(model: nn.Module, prompts: torch.Tensor, decode_batch: int, *,
                        tolerance: float | None = None,
                        rounds: int = DEFAULT_ROUNDS, wanted: list[str] | None = None,
                        steps: int = 4, prefill: torch.Tensor | None = None) -> ExpertChoice | None:
    """Check the runnable modes on ``prompts`` and measure them at prefill (``prefill``, the workload's
    prompts; default ``prompts``) and decode (``decode_batch`` rows); None when ``model`` has no
    GroupedMoE. A single runnable mode is taken without timing."""
    if not grouped_moes(model):
        return None
    runnable, unavailable = availability(model, wanted)
    if not runnable:
        raise ValueError("no experts mode can run here: " + "; ".join(f"{m}: {w}" for m, w in unavailable.items()))
    for mode, why in _differs(model, prompts, runnable, tolerance_for(model, tolerance)).items():
        runnable.remove(mode)
        unavailable[mode] = why
    rows = tiled(prompts, decode_batch, prompts.shape[1])
    decisions = []
    for phase in PHASES:
        if len(runnable) == 1:
            only = runnable[0]
            decisions.append(Decision(WHAT[phase], "ms", {}, {}, 0.0, [only], only, "the only runnable mode",
                                      {only: Option(only)}))
            continue
        timed = prompts if prefill is None else prefill
        options = [Option(mode, _timed(model, phase, mode, timed, rows, steps), simplicity=SIMPLICITY[mode])
                   for mode in runnable]
        decisions.append(decide(WHAT[phase], options, rounds, timer=reported, unit="ms"))
    modes = {phase: d.winner for phase, d in zip(PHASES, decisions)}
    set_modes(model, modes)
    return ExpertChoice(modes, runnable, unavailable, decisions)


def _timed(model: nn.Module, phase: str, mode: str, prompts: torch.Tensor, rows: torch.Tensor, steps: int):  # noqa: ANN202
    """A callable returning one timing in ms of ``phase`` with every GroupedMoE in ``mode``."""
    def run() -> float:
        set_modes(model, {phase: mode})
        if phase == "decode":
            return decode_step_s(model, rows, steps) * 1e3
        with torch.inference_mode():  # the prompt's last logits only, as generation computes them
            return wall_clock(lambda: model(prompts, last_only=True)) * 1e3
    return run


def replay_expert_modes(model: nn.Module, record: dict[str, Any] | None, source: str) -> ExpertChoice | None:
    """An earlier run's choice (its fusion.json ``experts``), taken without timing. A mode that cannot
    run here falls back to the default with the reason in ``unavailable``."""
    if not grouped_moes(model):
        return None
    runnable, unavailable = availability(model)
    wanted = dict(DEFAULT_MODES, **((record or {}).get("modes") or {}))
    modes = {}
    for phase in PHASES:
        mode = wanted[phase]
        modes[phase] = mode if mode in runnable else DEFAULT_MODES[phase]
        if mode not in runnable:
            unavailable[mode] = unavailable.get(mode, f"unknown mode {mode!r}") + f" (replayed {phase} mode)"
    set_modes(model, modes)
    decisions = [replayed(WHAT[phase], modes[phase], source, unit="ms") for phase in PHASES]
    return ExpertChoice(modes, runnable, unavailable, decisions, replayed_from=run_relative(source))


def apply_modes(model: nn.Module, modes: dict[str, str] | None) -> list[str]:
    """A recipe step's ``experts`` modes set on every GroupedMoE; returns what could not be honoured
    (a mode this device cannot run keeps the default, and the caller reports the line)."""
    wanted = dict(DEFAULT_MODES, **(modes or {}))
    unknown = sorted(set(wanted) - set(PHASES))
    if unknown:
        raise ValueError(f"fuse step: experts phases {unknown} unknown (known: {', '.join(PHASES)})")
    notes = []
    for name, moe in grouped_moes(model):
        if moe.dense:
            continue  # runs every expert on every token whatever the mode (SparseMoE.dense)
        for phase, mode in wanted.items():
            why = moe.mode_reason(mode)
            if why and mode in EXPERT_MODES:
                notes.append(f"{name}: {phase} experts mode {mode!r} cannot run here ({why}); runs "
                             f"{DEFAULT_MODES[phase]!r}")
                mode = DEFAULT_MODES[phase]
            elif why:
                raise ValueError(f"fuse step: {why}")
            moe.modes[phase] = mode
    return notes
