"""Optional ``torch.compile`` on top of fusion, kept only where a decode step gets faster beyond the noise.

Compiling is done in place (``nn.Module.compile``), so parameter names — and therefore the
checkpoint — are unchanged; the recipe step records the settings and replay compiles again on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from opus.fusion.measure import decode_step_s
from opus.runtime.timed_choice import DEFAULT_ROUNDS, Decision, Option, decide, replayed, reported


@dataclass
class CompileDecision:
    kept: bool
    eager_ms: float | None  # None: replayed, nothing timed
    compiled_ms: float | None
    reason: str
    settings: dict[str, Any]
    choice: Decision | None = field(default=None, repr=False)  # the timings behind it (opus.runtime.timed_choice)

    def record(self) -> dict[str, Any]:
        """For fusion.json (what ``run.decisions_from`` replays)."""
        margin = None if self.choice is None else round(self.choice.margin, 4)
        return {"kept": self.kept, "eager_ms": self.eager_ms, "compiled_ms": self.compiled_ms, "reason": self.reason,
                "settings": self.settings, "margin": margin}


def compile_model(model: nn.Module, settings: dict[str, Any]) -> nn.Module:
    """``settings``: ``{"backend": "inductor", "mode": None, "dynamic": None}``."""
    model.compile(backend=settings.get("backend", "inductor"), mode=settings.get("mode"),
                  dynamic=settings.get("dynamic"))
    return model


def uncompile(model: nn.Module) -> None:
    model._compiled_call_impl = None  # what nn.Module.compile set; eager again


def decide_compile(model: nn.Module, input_ids: torch.Tensor, settings: dict[str, Any], steps: int = 8,
                   rounds: int = DEFAULT_ROUNDS) -> CompileDecision:
    """Time a decode step eager and compiled (after warm-up) in interleaved rounds; keep the compile
    only where the shared rule of ``opus.runtime.timed_choice`` picks it: eager is the simpler, so it wins a tie
    within the noise margin."""
    try:
        compile_model(model, settings)
        decode_step_s(model, input_ids, 2)  # compiles prefill and decode shapes
        compiled_call = model._compiled_call_impl

        def on(call: Any) -> Any:  # the model switched between eager and compiled, round by round
            def run() -> float:
                model._compiled_call_impl = call
                return decode_step_s(model, input_ids, steps) * 1e3
            return run

        options = [Option("eager", on(None)), Option("compiled", on(compiled_call), simplicity=1)]
        choice = decide("torch.compile of the decode step", options, rounds, timer=reported, unit="ms")
    except Exception as exc:  # noqa: BLE001 - a backend that cannot compile this model is a "no"
        uncompile(model)
        reason = f"compile failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        return CompileDecision(False, decode_step_s(model, input_ids, steps) * 1e3, None, reason, settings)
    eager, compiled = choice.medians["eager"], choice.medians["compiled"]
    kept = choice.winner == "compiled"
    model._compiled_call_impl = compiled_call if kept else None
    said = f"decode step {eager:.2f} ms eager vs {compiled:.2f} ms compiled: {choice.reason}"
    return CompileDecision(kept, eager, compiled, ("kept: " if kept else "not kept: ") + said, settings, choice)


def replay_compile(model: nn.Module, record: dict[str, Any] | None, settings: dict[str, Any],
                   source: str) -> CompileDecision:
    """The compile choice of an earlier run (its fusion.json ``compile``), taken without timing."""
    kept = bool(record and record.get("kept"))
    settings = dict((record or {}).get("settings") or settings)
    if kept:
        compile_model(model, settings)
    return CompileDecision(kept, None, None, f"replayed from {source}", settings,
                           replayed("torch.compile of the decode step", "compiled" if kept else "eager", source,
                                    unit="ms"))
