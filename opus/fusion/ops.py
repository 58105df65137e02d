"""The fused operations rewritten graphs call: each one fx node in place of several.

They are ``torch.fx.wrap``-ed so a rewritten graph traced again (for node counts, or by a later
stage) keeps them as single calls. Each computes exactly what the ops it replaces computed, in the
same precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.fx.wrap
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` on the output of a fused gate/up GEMM (gate first, up second)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place on silu's fresh output: one allocation fewer


@torch.fx.wrap
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` when the two GEMMs stay separate."""
    return F.silu(gate).mul_(up)


@torch.fx.wrap
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Opus/HF RMSNorm (normalise in fp32, scale in the input dtype) as ``aten::rms_norm``.

    In fp32 the weight goes into the fused op; otherwise the fp32 normalisation is cast back
    before scaling, as the eager module does, so results stay identical.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@torch.fx.wrap
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and ``rms_norm(h)`` in one node: returns ``(h, normed)``."""
    h = x + residual
    return h, rms_norm(h, weight, eps)
