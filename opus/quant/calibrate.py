"""Calibration statistics: per-channel activation absmax and percentile at every linear's input.

A small sample of raw input rows is kept per layer too: SmoothQuant uses it to choose each group's
migration strength by the error it actually causes. Saved as safetensors and reused across retries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

CALIBRATION_FILE = "calibration.safetensors"  # ActivationStats.save: what quantize calibrates from

Progress = Callable[[float, float, str], None]


@dataclass
class ActivationStats:
    absmax: dict[str, torch.Tensor] = field(default_factory=dict)
    pctl: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    percentile: float = 99.9

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for kind in ("absmax", "pctl", "samples"):
            for name, value in getattr(self, kind).items():
                tensors[f"{kind}/{name}"] = value.contiguous()
        save_file(tensors, str(path), metadata={"percentile": str(self.percentile)})

    @classmethod
    def load(cls, path: Path) -> ActivationStats:
        from safetensors import safe_open

        stats = cls()
        with safe_open(str(path), framework="pt") as fh:
            stats.percentile = float((fh.metadata() or {}).get("percentile", 99.9))
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                kind, name = key.split("/", 1)
                getattr(stats, kind)[name] = fh.get_tensor(key)
        return stats

    def clip_value(self, name: str) -> torch.Tensor:
        """Per-channel clipping range at the configured percentile (absmax when unavailable)."""
        return self.pctl.get(name, self.absmax[name])


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


@torch.inference_mode()
def collect_stats(model: nn.Module, blocks: torch.Tensor, *, percentile: float = 99.9, batch_size: int = 4,
                  sample_rows: int = 256, progress: Progress | None = None) -> ActivationStats:
    """Run ``blocks`` [N, T] through the model and record every nn.Linear input's statistics."""
    stats = ActivationStats(percentile=percentile)
    quantile = percentile / 100.0
    generator = torch.Generator().manual_seed(0)

    def hook(name: str) -> Callable:
        def record(_: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if x.shape[0] == 0:  # an expert that received no token in this batch
                return
            a = x.abs()
            amax = a.amax(dim=0)
            rows = a if a.shape[0] <= 4096 else a[torch.randperm(a.shape[0], generator=generator)[:4096]]
            pct = torch.quantile(rows, quantile, dim=0)
            stats.absmax[name] = torch.maximum(stats.absmax[name], amax) if name in stats.absmax else amax
            stats.pctl[name] = torch.maximum(stats.pctl[name], pct) if name in stats.pctl else pct
            kept = stats.samples.get(name)
            if kept is None or kept.shape[0] < sample_rows:
                take = x[torch.randperm(x.shape[0], generator=generator)[:sample_rows]]
                stats.samples[name] = take if kept is None else torch.cat([kept, take])[:sample_rows]
        return record

    handles = [module.register_forward_pre_hook(hook(name))
               for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    try:
        total = blocks.shape[0]
        for start in range(0, total, batch_size):
            model(blocks[start:start + batch_size].to(_device(model)))
            if progress:
                progress(min(start + batch_size, total), total, "calibration")
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
