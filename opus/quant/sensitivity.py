"""Per-group, per-format sensitivity: quantize one group alone (fake-quant), measure the damage.

Fake quantization is used here (and in opus.quant.taylor) and nowhere else: it scores candidates;
the measured model always runs the real kernels. Scores: the increase of next-token cross-entropy on
calibration text (Δce, whose exponential is the predicted perplexity ratio) and the KL divergence of
the final logits.

Each (group, format) pair is one unit of work. ``Scoring`` says how a unit is measured: ``suffix``
(the default on Opus decoders) runs only the layers from the group's first one, from cached hidden
states, and scores the reference's top-k vocabulary plus the target and a tail bucket
(opus.quant.suffix_trials); ``full`` runs the whole model over the whole vocabulary; ``taylor`` predicts
every unit from one forward and backward pass per batch (opus.quant.taylor). Every score says how it
was obtained (``how``). A ``UnitCache`` keeps finished units, so a sweep stopped half-way resumes.

Given a ``pool`` (opus.cluster.ray_pool.RayPool) the units fan out: the model and the calibration
blocks go into the object store once, and each task scores a batch of units, contiguous in layer order
(a suffix task first runs the layers before its first unit once), with the same trial code; each score
then says where it ran (``where``). The Taylor proxy scores every unit from the same passes, so it fans
out by calibration batch instead: each task sums its batches' terms for all units, the driver adds them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from opus.quant.formats import FORMATS
from opus.quant.groups import QGroup
from opus.quant.suffix_trials import (
    HEAD,
    Reference,
    TrialLogits,
    Trunk,
    head_logits,
    reference,
    scores,
    start_layer,
    supports,
)
from opus.quant.taylor import HOW as TAYLOR_HOW
from opus.quant.taylor import taylor_totals, taylor_trials, unit_scores

Progress = Callable[[float, float, str], None]
Score = dict[str, Any]  # {"dce": float, "kl": float, "how": str, and "where" when it ran on a cluster}
METHODS = ("suffix", "full", "taylor")


@dataclass(frozen=True)
class Scoring:
    method: str = "suffix"  # one of METHODS (see the module docstring)
    top_k: int | None = 64  # suffix only; None: the full vocabulary

    def describe(self, start: int | None, num_layers: int | None = None) -> str:
        if self.method == "taylor":
            return TAYLOR_HOW
        if start is None:
            return "full forward, full vocabulary"
        vocab = "full vocabulary" if self.top_k is None else f"top-{self.top_k} + target + tail"
        where = "lm_head only" if start == num_layers else f"suffix from layer {start}"
        return f"{where}, {vocab}"


class UnitCache(Protocol):
    """Where finished units are kept between attempts (opus.pipeline.units.UnitStore is one)."""

    def get(self, unit: str) -> Score | None: ...

    def put(self, unit: str, value: Score) -> None: ...


Unit = tuple[QGroup, str]


class Tally:
    """A UnitCache (or none) that counts what a sweep reused and what it measured."""

    def __init__(self, inner: UnitCache | None = None) -> None:
        self.inner, self.reused, self.measured = inner, 0, 0

    def get(self, unit: str) -> Score | None:
        value = self.inner.get(unit) if self.inner is not None else None
        self.reused += value is not None
        return value

    def put(self, unit: str, value: Score) -> None:
        self.measured += 1
        if self.inner is not None:
            self.inner.put(unit, value)


def unit_name(group: QGroup, fmt: str) -> str:
    return f"{group.name}@{fmt}"


class _Trial:
    """Temporarily give a group's layers the weights (and inputs) the format would give them."""

    def __init__(self, model: nn.Module, group: QGroup, fmt: str, group_size: int) -> None:
        self.layers = [model.get_submodule(n) for n in group.modules]
        self.fmt, self.group_size = FORMATS[fmt], group_size
        self.saved: list[nn.Parameter] = []
        self.hooks: list = []

    def __enter__(self) -> _Trial:
        for layer in self.layers:
            # A new Parameter, not new .data: a tied lm_head shares its Parameter with the embedding,
            # whose lookup must keep the float table.
            self.saved.append(layer.weight)
            layer.weight = nn.Parameter(self.fmt.fake_quant_weight(layer.weight.data, self.group_size),
                                        requires_grad=False)
            self.hooks.append(layer.register_forward_pre_hook(
                lambda _m, args: (self.fmt.fake_quant_input(args[0]),)))
        return self

    def __exit__(self, *exc: object) -> None:
        for layer, weight in zip(self.layers, self.saved):
            layer.weight = weight
        for hook in self.hooks:
            hook.remove()


def _mean(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], blocks: torch.Tensor) -> tuple[float, float]:
    """Δce per predicted token and KL per position, from per-batch sums."""
    dce = kl = 0.0
    for d, k in batches:
        dce, kl = dce + float(d), kl + float(k)
    n, t = blocks.shape
    return dce / (n * (t - 1)), kl / (n * t)


def _full_trials(model: nn.Module, todo: list[Unit], blocks: torch.Tensor, batch_size: int,
                 group_size: int, scoring: Scoring) -> Iterator[tuple[Unit, Score]]:
    batches = blocks.split(batch_size)
    refs = [Reference(b[:, 1:], F.log_softmax(model(b).float(), dim=-1)) for b in batches]
    for group, fmt in todo:
        with _Trial(model, group, fmt, group_size):
            dce, kl = _mean((scores(TrialLogits(model(b).float()), ref) for b, ref in zip(batches, refs)), blocks)
        yield (group, fmt), {"dce": dce, "kl": kl, "how": scoring.describe(None)}


def _suffix_trials(model: nn.Module, todo: list[Unit], blocks: torch.Tensor, batch_size: int,
                   group_size: int, scoring: Scoring) -> Iterator[tuple[Unit, Score]]:
    trunk = Trunk(model, blocks.shape[1], blocks.device)
    n = trunk.num_layers
    batches = blocks.split(batch_size)
    hidden = [trunk.embed(b) for b in batches]
    refs = [reference(model.lm_head, trunk.head_input(trunk.run(h, 0)), b, scoring.top_k)
            for h, b in zip(hidden, batches)]
    at = 0  # the layer whose input ``hidden`` holds: advanced once, as the sorted units need it
    for group, fmt in sorted(todo, key=lambda unit: start_layer(unit[0], n)):
        start = start_layer(group, n)
        hidden = [trunk.run(h, at, start) for h in hidden]
        at = start
        on_head = HEAD in group.modules
        with _Trial(model, group, fmt, group_size):
            dce, kl = _mean((scores(head_logits(model, trunk.head_input(trunk.run(h, start)), ref, on_head), ref)
                             for h, ref in zip(hidden, refs)), blocks)
        yield (group, fmt), {"dce": dce, "kl": kl, "how": scoring.describe(start, n)}


def _trials(model: nn.Module, scoring: Scoring) -> Callable[..., Iterator[tuple[Unit, Score]]]:
    if not supports(model):  # both shortcuts need Opus's decoder
        return _full_trials
    return {"suffix": _suffix_trials, "taylor": taylor_trials}.get(scoring.method, _full_trials)


def scores_smoothed_in_one_pass(model: nn.Module, scoring: Scoring) -> bool:
    """Whether the sweep takes SmoothQuant's factors as ``input_scales`` (the Taylor proxy on Opus's
    decoders: one pass scores plain and smoothed formats) instead of a second sweep of the smoothed model."""
    return _trials(model, scoring) is taylor_trials


TASK = "opus.quant.sensitivity:score_batch"  # what a cluster task runs (opus.cluster.ray_pool)
TASKS_PER_SLOT = 4  # small enough tasks that a retry or a kill loses little


def _remote_trials(pool: Any, model: nn.Module, todo: list[Unit], blocks: torch.Tensor, batch_size: int,
                   group_size: int, scoring: Scoring) -> Iterator[tuple[Unit, Score]]:
    """The same trials as tasks on a cluster, as they finish."""
    from opus.cluster.wire import pack_model

    if scoring.method == "suffix" and supports(model):  # contiguous in layer order: each task's prefix runs once
        layers = len(model.model.layers)
        todo = sorted(todo, key=lambda unit: start_layer(unit[0], layers))
    per_task = pool.settings.units_per_task or max(1, math.ceil(len(todo) / (TASKS_PER_SLOT * pool.slots)))
    batches = [todo[i:i + per_task] for i in range(0, len(todo), per_task)]
    shared = pool.share(*pack_model(model, {"blocks": blocks.cpu()}))
    settings = {"batch_size": batch_size, "group_size": group_size, "scoring": asdict(scoring)}
    payloads = [json.dumps({**settings, "units": [[asdict(g), fmt] for g, fmt in batch]}) for batch in batches]
    for finished in pool.run(TASK, shared, payloads):
        for unit, score in zip(batches[finished.index], json.loads(finished.result)):
            yield unit, {**score, "where": finished.where}


TAYLOR_TASK = "opus.quant.sensitivity:taylor_batches"
SCALE = "scale."  # the prefix of SmoothQuant's input scales among a Taylor sweep's shared tensors


def _remote_taylor(pool: Any, model: nn.Module, todo: list[Unit], blocks: torch.Tensor, batch_size: int,
                   group_size: int, input_scales: dict[str, torch.Tensor] | None) -> Iterator[tuple[Unit, Score]]:
    """The proxy's passes split by calibration batch: each task sums its batches' terms for every unit's
    layers, and the sums are added in batch order (with one batch a task, as the local sweep adds them)."""
    from opus.cluster.wire import pack_model

    count = math.ceil(blocks.shape[0] / batch_size)
    per_task = max(1, math.ceil(count / (TASKS_PER_SLOT * pool.slots)))
    spans = [(i, min(count, i + per_task)) for i in range(0, count, per_task)]
    # A group's readers share one factor tensor; safetensors stores no shared memory (each is a vector).
    extra = {"blocks": blocks.cpu(), **{SCALE + n: s.cpu().clone() for n, s in (input_scales or {}).items()}}
    shared = pool.share(*pack_model(model, extra))
    job = {"batch_size": batch_size, "group_size": group_size, "units": [[asdict(g), fmt] for g, fmt in todo]}
    partial: dict[int, list[list[Any]]] = {}
    places: set[str] = set()
    for finished in pool.run(TAYLOR_TASK, shared, [json.dumps({**job, "batches": span}) for span in spans]):
        partial[finished.index] = json.loads(finished.result)
        places.add(finished.where)
    totals: dict[tuple[str, str], float] = {}
    for index in range(len(spans)):
        for layer, fmt, value in partial[index]:
            totals[(layer, fmt)] = totals.get((layer, fmt), 0.0) + value
    where = f"{len(spans)} calibration-batch task{'s' * (len(spans) > 1)} on " + ", ".join(sorted(places))
    for unit, score in unit_scores(todo, totals, blocks):
        yield unit, {**score, "where": where}


def taylor_batches(meta: str, blob: bytes, payload: str) -> str:
    """A cluster task: the Taylor terms of the payload's units over its span of calibration batches."""
    from opus.cluster.wire import unpack_model

    model, extra = unpack_model(meta, blob)
    job = json.loads(payload)
    todo = [(QGroup(**group), fmt) for group, fmt in job["units"]]
    scales = {k.removeprefix(SCALE): v for k, v in extra.items() if k.startswith(SCALE)}
    batches = extra["blocks"].split(job["batch_size"])[slice(*job["batches"])]
    totals = taylor_totals(model, todo, batches, job["group_size"], scales or None)
    return json.dumps([[layer, fmt, value] for (layer, fmt), value in sorted(totals.items())])


def score_batch(meta: str, blob: bytes, payload: str) -> str:
    """A cluster task: rebuild the model (opus.cluster.wire), score the payload's units, as JSON."""
    from opus.cluster.wire import unpack_model

    model, extra = unpack_model(meta, blob)
    job = json.loads(payload)
    todo = [(QGroup(**group), fmt) for group, fmt in job["units"]]
    scoring = Scoring(**job["scoring"])
    with torch.inference_mode():
        found = {unit_name(*unit): score for unit, score in
                 _trials(model, scoring)(model, todo, extra["blocks"], job["batch_size"], job["group_size"], scoring)}
    return json.dumps([found[unit_name(*unit)] for unit in todo])


@torch.inference_mode()
def measure_sensitivity(model: nn.Module, groups: list[QGroup], formats: list[str], blocks: torch.Tensor,
                        *, group_size: int = 128, batch_size: int = 4, scoring: Scoring | None = None,
                        units: UnitCache | None = None, progress: Progress | None = None,
                        done: int = 0, total: int | None = None, pool: Any = None,
                        input_scales: dict[str, torch.Tensor] | None = None) -> dict[str, dict[str, Score]]:
    """``{group: {format: {"dce", "kl", "how"}}}`` for every group and candidate format it can take.

    Units found in ``units`` are reused, not measured again; each measured one is put there as soon
    as it is finished. With a ``pool`` the units not found run as tasks on its cluster.
    ``input_scales`` (only where ``scores_smoothed_in_one_pass``): SmoothQuant's factors, with which
    activation formats are scored as they run after smoothing while the model stays as it is."""
    scoring = scoring or Scoring()
    if scoring.method not in METHODS:
        raise ValueError(f"unknown sensitivity method '{scoring.method}' (known: {', '.join(METHODS)})")
    if input_scales is not None and not scores_smoothed_in_one_pass(model, scoring):
        raise ValueError(f"the {scoring.method} sweep scores smoothed formats on the smoothed model only")
    blocks = blocks.to(next(model.parameters()).device)
    total = total or len(groups) * len(formats)
    found: dict[str, Score] = {}
    todo: list[Unit] = []
    reused = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1  # counted when skipped too: the total counts every (group, format) pair
        if progress:
            progress(done, total, f"sensitivity {what}" + (f" ({reused} reused)" if reused else ""))

    for group in groups:
        for fmt in formats:
            if any(FORMATS[fmt].unsupported(model.get_submodule(n), group_size) for n in group.modules):
                tick(f"{group.name} {fmt} (format cannot take it)")
                continue
            kept = units.get(unit_name(group, fmt)) if units is not None else None
            if kept is None:
                todo.append((group, fmt))
                continue
            found[unit_name(group, fmt)] = kept
            reused += 1
            tick(f"{group.name} {fmt}")
    if todo:
        if pool is not None and _trials(model, scoring) is taylor_trials:  # its batches fan out
            trials = _remote_taylor(pool, model, todo, blocks, batch_size, group_size, input_scales)
        elif pool is not None:
            trials = _remote_trials(pool, model, todo, blocks, batch_size, group_size, scoring)
        else:
            extra = {"input_scales": input_scales} if input_scales is not None else {}
            trials = _trials(model, scoring)(model, todo, blocks, batch_size, group_size, scoring, **extra)
        for (group, fmt), score in trials:
            found[unit_name(group, fmt)] = score
            if units is not None:
                units.put(unit_name(group, fmt), score)
            tick(f"{group.name} {fmt}")
    return {g.name: {f: found[unit_name(g, f)] for f in formats if unit_name(g, f) in found}
            for g in groups if any(unit_name(g, f) in found for f in formats)}
