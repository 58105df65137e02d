"""The fusion pass: find sites per region, keep each rewrite only if the region still computes the
same, and write every decision down so the recipe can replay it.

``fuse_model`` decides (it needs a probe run of the model); ``apply_fusion`` replays a recipe step
on a freshly loaded base model (no probe: the decisions were already checked). Both yield the same
structure, parameter names included, so the checkpoint's tensors load into it.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from opus.fusion import ops
from opus.fusion.capture import Recording, record_regions, replay_error, tolerance_for
from opus.fusion.expert_modes import apply_modes
from opus.fusion.measure import count_ops
from opus.fusion.moe import GroupedMoE, group_moe, moe_reason
from opus.fusion.patterns import FIND, PATTERNS, Site, rebuild
from opus.fusion.tracing import Ignore, regions, replace_module, trace, try_trace
from opus.recipe import RecipeStep, register_transform

KIND = "fuse"
FUSION_FILE = "fusion.json"  # the fuse stage's report: sites, ignored modules, compile choice
FX_ORDER = ("linear_group", "silu_mul", "add_rmsnorm", "rmsnorm")
STEP_VERSION = 1


class FuseStep(RecipeStep):
    """The fuse stage's recipe step: the sites rewritten (``Site.record``), the modules the ignore-list kept
    out, the compile settings when compiling was kept, and the grouped MoE's mode per phase when chosen."""

    kind: Literal["fuse"] = KIND
    version: int = STEP_VERSION
    sites: list[dict[str, Any]] = Field(default_factory=list)
    ignored: list[dict[str, str]] = Field(default_factory=list)
    compile: dict[str, Any] | None = None
    experts: dict[str, str] | None = None  # absent in steps written before modes existed: the default modes

    @field_validator("compile", mode="before")
    @classmethod
    def _not_compiled(cls, value: Any) -> Any:
        return None if value is False else value  # ``false``: not compiled, as some steps said it

    @field_validator("version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != STEP_VERSION:
            raise ValueError(f"fuse step version {version} is not supported (this Opus: {STEP_VERSION})")
        return version


@dataclass
class FusionConfig:
    patterns: list[str] = field(default_factory=lambda: list(PATTERNS))
    ignore: list[str] = field(default_factory=list)
    tolerance: float | None = None  # relative max diff per region; None: by dtype


@dataclass
class FusionOutcome:
    model: nn.Module
    sites: list[Site]
    skipped: list[Site]
    ignored: list[dict[str, str]]

    def step(self, compile_cfg: dict[str, Any] | None = None, experts: dict[str, str] | None = None) -> FuseStep:
        """The recipe step; ``experts`` (phase -> mode of the grouped MoE, ``opus.fusion.expert_modes``)
        only when chosen: steps without it replay the default modes, as written before modes existed."""
        return FuseStep(sites=[s.record() for s in self.sites], ignored=self.ignored, compile=compile_cfg,
                        experts=dict(experts) if experts else None)

    def patterns(self) -> dict[str, dict[str, Any]]:
        """Per pattern: sites fused, skipped, and the reasons (each with a count and an example)."""
        out: dict[str, dict[str, Any]] = {p: {"fused": 0, "skipped": 0, "reasons": []} for p in PATTERNS}
        why: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        for site in self.sites:
            out.setdefault(site.pattern, {"fused": 0, "skipped": 0, "reasons": []})["fused"] += 1
        for site in self.skipped:
            out.setdefault(site.pattern, {"fused": 0, "skipped": 0, "reasons": []})["skipped"] += 1
            why[site.pattern][site.reason].append(site.region or "<root>")
        for pattern, reasons in why.items():
            out[pattern]["reasons"] = [f"{r} ({len(w)} site{'s' * (len(w) > 1)}, e.g. {w[0]})"
                                       for r, w in reasons.items()]
        return out


def _is_moe(module: nn.Module) -> bool:
    return isinstance(module, GroupedMoE) or moe_reason(module) is None


_NORM_GAIN: dict[tuple[Any, ...], tuple[int, int]] = {}


def _norm_gain(module: nn.Module) -> tuple[int, int]:
    """Dispatched ops of the eager norm vs ``aten::rms_norm`` on a sample (once per dtype/device)."""
    w = module.weight
    key = (type(module), w.dtype, w.device.type)
    if key not in _NORM_GAIN:
        x = torch.randn(2, 3, w.shape[-1], dtype=w.dtype, device=w.device)
        before = sum(count_ops(lambda: module(x)).values())
        after = sum(count_ops(lambda: ops.rms_norm(x, w, float(module.eps))).values())
        _NORM_GAIN[key] = (before, after)
    return _NORM_GAIN[key]


class _Pass:
    """One fusion decision pass over a model (state shared by the MoE and fx steps)."""

    def __init__(self, model: nn.Module, cfg: FusionConfig, rec: Recording) -> None:
        self.model, self.cfg, self.rec = model, cfg, rec
        self.ignore = Ignore(list(cfg.ignore))
        self.tol = tolerance_for(model, cfg.tolerance)
        self.sites: list[Site] = []
        self.skipped: list[Site] = []
        self.ignored: list[dict[str, str]] = []

    def skip(self, site: Site, reason: str) -> None:
        site.reason = reason
        self.skipped.append(site)

    def precheck(self, site: Site, module: nn.Module | None = None) -> str | None:
        if site.pattern not in self.cfg.patterns:
            return "pattern disabled in config"
        if site.reason:
            return site.reason
        region_ignored = self.ignore.module_reason(site.region, module) if module is not None else None
        return region_ignored or self.ignore.site_reason(site.pattern, site.full_names(), site.ops)

    def moe(self) -> None:
        for name, module in list(self.model.named_modules()):
            if not isinstance(module, nn.Module) or moe_reason(module) is not None:
                continue
            site = Site("moe_grouped", name, (), ops=(type(module).__name__,))
            reason = self.precheck(site, module)
            ignored = self.ignore.module_reason(name, module)
            if ignored:
                self.ignored.append({"module": name, "reason": ignored})
            grouped = group_moe(module) if reason is None else reason
            if isinstance(grouped, str):
                self.skip(site, grouped)
                continue
            calls = self.rec.calls.get(name)
            reason = replay_error(grouped, calls, self.tol) if calls else "not exercised by the probe"
            if reason:
                self.skip(site, reason)
                continue
            self.model = replace_module(self.model, name, grouped)
            self.sites.append(site)

    def fx(self) -> None:
        names = regions(self.model)
        for region in names:
            module = self.model.get_submodule(region)
            if _is_moe(module):
                continue  # grouped (or not) by the MoE step; its routing loop gains nothing from fx
            reason = self.ignore.module_reason(region, module)
            traced, error = (None, reason) if reason else try_trace(self.model, region, names)
            if traced is None:
                self.ignored.append({"module": region or "<root>", "reason": error})
                continue
            accepted = self._region_sites(region, module, names)
            if accepted:
                self.model = replace_module(self.model, region, build_region(self.model, region, names, accepted))
                self.sites.extend(accepted)

    def _region_sites(self, region: str, module: nn.Module, names: list[str]) -> list[Site]:
        calls = self.rec.calls.get(region)
        accepted: list[Site] = []
        for pattern in FX_ORDER:
            current = build_region(self.model, region, names, accepted)
            for site in FIND[pattern](current, region):
                reason = self.precheck(site, module)
                if reason is None and site.pattern in ("rmsnorm", "add_rmsnorm"):
                    before, after = _norm_gain(current.get_submodule(site.modules[0]))
                    reason = None if after < before else f"no gain: {after} ops fused vs {before} eager"
                if reason is None and not calls:
                    reason = "not exercised by the probe: cannot verify"
                if reason is None:
                    reason = self._try(region, names, accepted + [site], calls)
                if reason:
                    self.skip(site, reason)
                else:
                    accepted.append(site)
        return accepted

    def _try(self, region: str, names: list[str], sites: list[Site], calls: list) -> str | None:
        try:
            trial = build_region(self.model, region, names, sites)
        except (LookupError, ValueError, RuntimeError) as exc:
            return f"rewrite failed: {exc}"
        return replay_error(trial, calls, self.tol)


def build_region(model: nn.Module, region: str, names: list[str], sites: list[Site]):  # noqa: ANN201
    """A fresh trace of ``region`` with ``sites`` applied (the original module is left intact)."""
    opaque = {n[len(region) + 1:] if region else n for n in names
              if n != region and (not region or n.startswith(region + "."))}
    return rebuild(trace(model.get_submodule(region), opaque), sites)


def fuse_model(model: nn.Module, cfg: FusionConfig, probe: Callable[[nn.Module], None]) -> FusionOutcome:
    """Fuse what the config allows and the probe confirms; ``probe(model)`` runs the model once or more.

    The model is changed in place where possible; use ``outcome.model`` (a fused root replaces it).
    """
    unknown = sorted(set(cfg.patterns) - set(PATTERNS))
    if unknown:
        raise ValueError(f"unknown fusion pattern(s) {unknown}; known: {', '.join(PATTERNS)}")
    moe_names = [n for n, m in model.named_modules() if moe_reason(m) is None]
    rec = record_regions(model, sorted(set(regions(model)) | set(moe_names)), probe)
    state = _Pass(model, cfg, rec)
    state.moe()
    state.fx()
    state.model.eval()
    return FusionOutcome(state.model, state.sites, state.skipped, state.ignored)


def apply_fusion(model: nn.Module, step: FuseStep) -> nn.Module:
    """Replay a ``fuse`` recipe step: the same structure, built from the (base) weights at hand."""
    sites = [Site.from_record(r) for r in step.sites]
    for site in (s for s in sites if s.pattern == "moe_grouped"):
        grouped = group_moe(model.get_submodule(site.region))
        if isinstance(grouped, str):
            raise ValueError(f"fuse step: cannot group the MoE at {site.region}: {grouped}")
        model = replace_module(model, site.region, grouped)
    by_region: dict[str, list[Site]] = defaultdict(list)
    for site in (s for s in sites if s.pattern != "moe_grouped"):
        by_region[site.region].append(site)
    names = regions(model)
    for region in names:  # deepest first, as when the decisions were made
        if region in by_region:
            try:
                built = build_region(model, region, names, by_region.pop(region))
            except Exception as exc:
                raise ValueError(f"fuse step: cannot replay the rewrite of '{region}': {exc}") from exc
            model = replace_module(model, region, built)
    if by_region:
        raise ValueError(f"fuse step names regions this model does not have: {', '.join(sorted(by_region))}")
    for note in apply_modes(model, step.experts):  # e.g. grouped chosen on CUDA, loaded on a CPU
        warnings.warn(f"fuse step: {note}", RuntimeWarning, stacklevel=2)
    if step.compile:
        from opus.fusion.compiled import compile_model

        compile_model(model, step.compile)
    return model.eval()


@register_transform(KIND, FuseStep, provider_module="opus.fusion.rewrite")
def _apply_fuse_step(model: nn.Module, step: FuseStep) -> nn.Module:
    return apply_fusion(model, step)


__all__ = ["FuseStep", "FusionConfig", "FusionOutcome", "apply_fusion", "build_region", "fuse_model", "try_trace"]
