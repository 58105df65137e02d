"""Sensitivity from one backward pass per batch: a second-order Taylor proxy (as ModelOpt's AutoQuantize).

Quantizing a linear layer changes its output by ΔY = Y_q − Y (weights and, for activation formats,
inputs as the kernel would see them). To second order, with the empirical Fisher standing in for the
Hessian of the loss, the summed cross-entropy moves by Σ g·ΔY + ½ Σ g²·ΔY² (g = ∂L/∂Y), summed over
tokens and output features; a group's score is the sum over its layers (cross-terms dropped).
AutoQuantize keeps only the second term (its expectation over a trained model's data). Here the first
is kept as well: the measured scores are the change on these very calibration blocks, and on a model
that int8 barely moves (K3) the first-order term is most of it, of either sign (README: the proxy
against the full measure).
One forward and one backward pass per calibration batch give every layer's input and output gradient;
each (layer, format) pair then costs one fake-quantized GEMM, instead of a (partial) forward per unit.
``plan.yaml`` says ``taylor proxy`` beside each score obtained so.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from opus.quant.formats import FORMATS
from opus.quant.groups import QGroup

HOW = "taylor proxy (first and second order in the layer outputs, one backward pass per batch)"


class _Capture:
    """Each watched linear's input and the gradient of the loss with respect to its output."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}  # kept, not recomputed: one GEMM less per (layer, format)
        self.grads: dict[str, torch.Tensor] = {}
        self.hooks = [model.get_submodule(n).register_forward_hook(self._hook(n)) for n in names]
        # The graph starts at the embedding's output: gradients reach every activation, no weight needs one.
        self.hooks.append(model.model.embed_tokens.register_forward_hook(
            lambda _m, _a, out: out.detach().requires_grad_(True)))

    def _hook(self, name: str):  # noqa: ANN202
        def hook(_module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            self.inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1])
            self.outputs[name] = out.detach().reshape(-1, out.shape[-1])
            out.register_hook(lambda g: self.grads.__setitem__(name, g.detach().reshape(-1, g.shape[-1])))
        return hook

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        self.grads.clear()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class _Weights:
    """Each (layer, format)'s fake-quantized weight (SmoothQuant's factor folded in first where one is
    given), kept across calibration batches while they fit in ``budget`` bytes, rebuilt per batch after."""

    def __init__(self, model: nn.Module, group_size: int, scales: dict[str, torch.Tensor], budget: int) -> None:
        self.model, self.group_size, self.scales, self.budget = model, group_size, scales, budget
        self.kept: dict[tuple[str, str], torch.Tensor] = {}

    def scale(self, name: str, fmt: str) -> torch.Tensor | None:
        return self.scales.get(name) if FORMATS[fmt].acts_quantized else None

    def get(self, name: str, fmt: str) -> torch.Tensor:
        if (name, fmt) in self.kept:
            return self.kept[(name, fmt)]
        weight = self.model.get_submodule(name).weight.detach()
        s = self.scale(name, fmt)
        if s is not None:
            weight = (weight * s.to(weight.device)[None, :]).to(weight.dtype)
        fake = FORMATS[fmt].fake_quant_weight(weight, self.group_size)
        if fake.numel() * fake.element_size() <= self.budget:
            self.budget -= fake.numel() * fake.element_size()
            self.kept[(name, fmt)] = fake
        return fake


def _cache_budget(device: torch.device, batches: int) -> int:
    """Bytes of fake-quantized weights worth keeping: none for one batch, else a quarter of free memory."""
    if batches < 2:
        return 0
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return psutil.virtual_memory().available // 4


def _layer_score(layer: nn.Linear, fmt: str, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor,
                 group_size: int, fake_weight: torch.Tensor | None = None) -> float:
    """Σ g·ΔY + ½ Σ g²·ΔY² for one layer in one format over one batch's tokens.

    ``fake_weight``: the layer's weight already fake-quantized (and ``x`` already divided by its
    SmoothQuant factor); by default it is built from ``layer``."""
    spec = FORMATS[fmt]
    if fake_weight is None:
        fake_weight = spec.fake_quant_weight(layer.weight.detach(), group_size)
    bias = None if layer.bias is None else layer.bias.detach()
    # In place on the GEMM's fresh output, and g²·ΔY² as (g·ΔY)²: two passes over [tokens, out] where
    # there were seven (on a 49k-vocabulary lm_head each pass is ~200 MB per calibration batch).
    gd = F.linear(spec.fake_quant_input(x), fake_weight, bias).float()
    gd = gd.sub_(y).mul_(grad) if gd.dtype == y.dtype == grad.dtype else (gd - y.float()) * grad.float()
    flat = gd.view(-1)
    return float(flat.sum() + 0.5 * torch.dot(flat, flat))


def _batch_scores(model: nn.Module, by_layer: dict[str, set[str]], capture: _Capture, weights: _Weights,
                  totals: dict[tuple[str, str], float], group_size: int) -> None:
    for n, fmts in by_layer.items():
        if n not in capture.grads:  # an expert no token was routed to in this batch
            continue
        layer, x = model.get_submodule(n), capture.inputs[n]
        smoothed = None  # the input the smoothed layer reads, divided once for all its formats
        for fmt in sorted(fmts):
            s = weights.scale(n, fmt)
            if s is not None and smoothed is None:
                smoothed = (x / s.to(x.device)).to(x.dtype)
            totals[(n, fmt)] += _layer_score(layer, fmt, x if s is None else smoothed, capture.outputs[n],
                                             capture.grads[n], group_size, weights.get(n, fmt))


Totals = dict[tuple[str, str], float]  # (layer, format) -> Σ over tokens of its Taylor terms


def taylor_totals(model: nn.Module, todo: list[tuple[QGroup, str]], batches: Sequence[torch.Tensor],
                  group_size: int, input_scales: dict[str, torch.Tensor] | None = None) -> Totals:
    """Every (layer, format) pair's summed terms over ``batches``, added batch after batch.

    ``input_scales`` (opus.quant.smooth.input_scales): formats that quantize activations are scored as
    the model would run after SmoothQuant, input ÷ s and weight × s (the float output and so the
    gradients are unchanged), so one pass serves the plain and the smoothed formats."""
    names = sorted({n for group, _ in todo for n in group.modules})
    by_layer: dict[str, set[str]] = {n: set() for n in names}
    for group, fmt in todo:
        for n in group.modules:
            by_layer[n].add(fmt)
    totals = {(n, f): 0.0 for n, fmts in by_layer.items() for f in fmts}
    if not batches:
        return totals
    weights = _Weights(model, group_size, input_scales or {}, _cache_budget(batches[0].device, len(batches)))
    capture = _Capture(model, names)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for batch in batches:
                capture.clear()
                logits = model(batch.clone())  # a normal tensor: inference-mode ids cannot enter autograd
                loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                       batch[:, 1:].reshape(-1), reduction="sum")
                loss.backward()
                with torch.no_grad():
                    _batch_scores(model, by_layer, capture, weights, totals, group_size)
    finally:
        capture.clear()
        capture.remove()
        for p in trainable:
            p.requires_grad_(True)
    return totals


def unit_scores(todo: list[tuple[QGroup, str]], totals: Totals, blocks: torch.Tensor,
                ) -> Iterator[tuple[tuple[QGroup, str], dict[str, Any]]]:
    """Each unit's Δce per predicted token: its layers' totals over every calibration block."""
    predicted = blocks.shape[0] * (blocks.shape[1] - 1)
    for group, fmt in todo:
        dce = sum(totals[(n, fmt)] for n in group.modules) / predicted
        yield (group, fmt), {"dce": dce, "kl": None, "how": HOW}


def taylor_trials(model: nn.Module, todo: list[tuple[QGroup, str]], blocks: torch.Tensor, batch_size: int,
                  group_size: int, scoring: Any, input_scales: dict[str, torch.Tensor] | None = None,
                  ) -> Iterator[tuple[tuple[QGroup, str], dict[str, Any]]]:
    """Every unit's score from the same passes (``taylor_totals``); yielded once all batches are done."""
    totals = taylor_totals(model, todo, blocks.split(batch_size), group_size, input_scales)
    yield from unit_scores(todo, totals, blocks)
