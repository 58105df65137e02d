"""Per-group, per-format sensitivity: quantize one group alone (fake-quant), measure the damage.

Fake quantization is used here and only here: it scores candidates; the measured model always runs
the real kernels. Scores: the increase of next-token cross-entropy on calibration text (Δce, whose
exponential is the predicted perplexity ratio) and the KL divergence of the final logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from opus.quant.formats import FORMATS
from opus.quant.groups import QGroup

Progress = Callable[[float, float, str], None]


def _logprobs(model: nn.Module, blocks: torch.Tensor, batch_size: int) -> torch.Tensor:
    outs = [F.log_softmax(model(blocks[i:i + batch_size]).float(), dim=-1)
            for i in range(0, blocks.shape[0], batch_size)]
    return torch.cat(outs)


def _scores(logp: torch.Tensor, ref: torch.Tensor, blocks: torch.Tensor) -> tuple[float, float]:
    targets = blocks[:, 1:]
    ce = -logp[:, :-1].gather(-1, targets.unsqueeze(-1)).mean()
    ce_ref = -ref[:, :-1].gather(-1, targets.unsqueeze(-1)).mean()
    kl = (ref.exp() * (ref - logp)).sum(-1).mean()
    return float(ce - ce_ref), float(kl)


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


@torch.inference_mode()
def measure_sensitivity(model: nn.Module, groups: list[QGroup], formats: list[str], blocks: torch.Tensor,
                        *, group_size: int = 128, batch_size: int = 4, progress: Progress | None = None,
                        done: int = 0, total: int | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """``{group: {format: {"dce": float, "kl": float}}}`` for every group and candidate format."""
    blocks = blocks.to(next(model.parameters()).device)
    ref = _logprobs(model, blocks, batch_size)
    total = total or len(groups) * len(formats)
    scores: dict[str, dict[str, dict[str, float]]] = {}
    for group in groups:
        for fmt in formats:
            done += 1  # counted when skipped too: the total counts every (group, format) pair
            if not any(FORMATS[fmt].unsupported(model.get_submodule(n), group_size) for n in group.modules):
                with _Trial(model, group, fmt, group_size):
                    dce, kl = _scores(_logprobs(model, blocks, batch_size), ref, blocks)
                scores.setdefault(group.name, {})[fmt] = {"dce": dce, "kl": kl}
            if progress:
                progress(done, total, f"sensitivity {group.name} {fmt}")
    return scores
