"""Where a forward pass spends its time: latency, weights, activations and aten ops per module and role.

One prefill (``batch_size`` prompts of ``input_len`` tokens) and one decode step (one token per row,
the KV cache filled by that prefill) are run three ways:

- plain, without hooks: the phase totals (``prefill_ms``, ``decode_ms``) the report quotes;
- with forward pre/post hooks on every module: per-module *self* time (inclusive time minus the
  inclusive time of hooked children), so the modules partition the forward pass exactly and the
  root module's self time (residual adds, the layer loop, position ids...) lands in "other". Hook
  overhead inflates a parent's self time a little, so self times are rescaled to add up to the plain
  total: shares are what the profile is for, absolute per-module times are approximate;
- once under a ``TorchDispatchMode``: aten ops dispatched and bytes they write, each attributed to
  the innermost module running, plus the bytes of every module's outputs.

Timed runs are ``warmup`` discarded then ``repeats`` kept, medians reported. On CUDA every hook
synchronizes, so times are kernel times, not launch-queue times (and the hooked run is slower).

Roles come from module names (Hugging Face conventions) and types, by ``opus.models.layout`` (the
vocabulary quantization groups use too), so any ``nn.Module`` whose forward takes ``input_ids`` gets
a profile; unmatched modules are "other". "router" is the router linear plus
an MoE block's own time (softmax, top-k, token gathers, index_add): routing and dispatch glue, the
part grouped GEMMs remove. "experts" are the expert MLPs themselves (shared experts included). A
model without Opus's KV-cache interface (``forward(input_ids, cache, start_pos, last_only)``) gets a
prefill profile only.
Workload share weights one prefill against ``output_len`` decode steps (each measured at the
prefill's cache length: later steps attend to a slightly longer cache).

``profile.json``: ``prefill`` / ``decode`` (``ms`` unhooked, ``hooked_ms`` with the measured hook cost
removed, ``ops``, ``ms_by_role``, ``shares``), ``groups`` (per role: workload ``share``,
``prefill_ms``, ``decode_ms``, ``param_bytes``, ``act_bytes`` — outputs of the outermost modules of
the role —, ``written_bytes`` — outputs of its aten ops —, ``ops``; per-phase values as
``{"prefill": n, "decode": n}``), ``hotspots``, ``modules`` (same fields per module, by share),
``ops``, ``param_bytes``, ``workload``.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from opus.kv.cache import CacheFactory, cache_factory
from opus.models.layout import ROLES, module_roles  # roles: one vocabulary for profile.json and plans
from opus.runtime.engine import logits_of, model_device, supports_cache, sync

PROFILE_FILE = "profile.json"  # the profile stage's document (see the module docstring), drawn by the report
PHASES = ("prefill", "decode")
ProgressFn = Callable[[float, float | None, str], None]


@dataclass(frozen=True)
class ProfileWorkload:
    batch_size: int
    input_len: int
    output_len: int  # decode steps one prefill is weighted against
    warmup: int = 1
    repeats: int = 3


# -- weights ------------------------------------------------------------------------------------
def weight_bytes_by_module(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters and buffers per owning module; a shared storage counts once (first owner).

    Buffers count because quantized layers keep their packed weights as buffers.
    """
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = defaultdict(int)
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        key = (tensor.data_ptr(), tensor.numel())
        if key in seen:
            continue
        seen.add(key)
        out[name.rpartition(".")[0]] += tensor.numel() * tensor.element_size()
    return dict(out)


# -- recording ----------------------------------------------------------------------------------
def _nbytes(obj: Any) -> int:
    leaves, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class _Recorder:
    """Hooks on every module keeping the call stack; self time = inclusive − hooked children."""

    def __init__(self, model: nn.Module, sync: bool) -> None:
        self.model, self.sync = model, sync
        self.timing = self.counting = False
        self.stack: list[list[Any]] = []  # [name, start, children's inclusive time + their hook cost]
        self.hook_s = 0.0  # hook cost a parent sees per hooked child call (see calibrate)
        self.self_s: dict[str, float] = defaultdict(float)
        self.act: dict[str, int] = defaultdict(int)
        self.ops: dict[str, int] = defaultdict(int)
        self.written: dict[str, int] = defaultdict(int)
        self.handles: list[Any] = []

    def calibrate(self, calls: int = 64, trials: int = 7) -> None:
        """Measure what a pair of hooks costs around a call, so parents are not charged for it.

        Without this an MoE block's self time would include the hooks of its dozens of experts.
        """
        probe = nn.Sequential(*[nn.Identity() for _ in range(calls)])
        x = torch.zeros(1)

        def timed() -> float:
            start = time.perf_counter()
            probe(x)
            return time.perf_counter() - start

        plain = statistics.median(timed() for _ in range(trials))
        model, self.model = self.model, probe
        self.attach()
        hooked = statistics.median(timed() for _ in range(trials))
        self.detach()
        self.model = model
        self.reset()
        self.hook_s = max(0.0, (hooked - plain) / calls)

    def attach(self) -> None:
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(partial(self._pre, name)))
            self.handles.append(module.register_forward_hook(partial(self._post, name), always_call=True))

    def reset(self) -> None:
        self.stack.clear()
        for table in (self.self_s, self.act, self.ops, self.written):
            table.clear()

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre(self, name: str, module: nn.Module, args: Any) -> None:
        if self.timing and self.sync:
            torch.cuda.synchronize()
        self.stack.append([name, time.perf_counter(), 0.0])

    def _post(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.timing and self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        _, start, children = self.stack.pop()
        inclusive = now - start
        self.self_s[name] += inclusive - children
        if self.stack:
            self.stack[-1][2] += inclusive + self.hook_s
        if self.counting:
            self.act[name] += _nbytes(output)

    def count(self, func: Any, out: Any) -> None:
        owner = self.stack[-1][0] if self.stack else ""
        self.ops[owner] += 1
        # Views and in-place ops write no new activation memory.
        if not any(r.alias_info is not None for r in func._schema.returns):
            self.written[owner] += _nbytes(out)


class _OpCounter(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.recorder.count(func, out)
        return out


# -- running ------------------------------------------------------------------------------------
def prompt_ids(model: nn.Module, batch_size: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random token ids below the model's vocabulary size (from its config or its first embedding)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is None:
            raise ValueError(f"cannot profile {type(model).__name__}: its forward must take input_ids, "
                             "and neither model.config.vocab_size nor an nn.Embedding says how many ids exist")
        vocab = embedding.num_embeddings
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch_size, length), generator=generator).to(model_device(model))


def _run_phases(model: nn.Module, ids: torch.Tensor, factory: CacheFactory | None,
                before: Callable[[str], None], after: Callable[[str], None]) -> dict[str, float | None]:
    """One prefill, then one decode step on the cache it filled; seconds per phase (decode None if n/a).

    ``before(phase)`` / ``after(phase)`` bracket each phase just outside its timed window.
    """
    device = model_device(model)
    cache = factory(ids.shape[0], ids.shape[1] + 1) if factory else None

    def timed(phase: str, fn: Callable[[], Any]) -> tuple[float, Any]:
        sync(device)
        before(phase)
        start = time.perf_counter()
        out = fn()
        sync(device)
        elapsed = time.perf_counter() - start
        after(phase)
        return elapsed, out

    if cache is None:
        return {"prefill": timed("prefill", lambda: model(ids))[0], "decode": None}
    prefill, out = timed("prefill", lambda: model(ids, cache=cache, start_pos=0, last_only=True))
    token = logits_of(out)[:, -1].argmax(dim=-1, keepdim=True)
    decode, _ = timed("decode", lambda: model(token, cache=cache, start_pos=ids.shape[1], last_only=True))
    return {"prefill": prefill, "decode": decode}


def profile_model(model: nn.Module, workload: ProfileWorkload, factory: CacheFactory | None = None,
                  progress: ProgressFn | None = None, top: int = 10, max_modules: int = 256) -> dict[str, Any]:
    """Profile one prefill and one decode step of ``model``; returns the ``profile.json`` document.

    ``factory`` builds the KV cache (default: the model's default cache); it is ignored for models
    without the cache interface.
    """
    lm = supports_cache(model)
    factory = (factory or cache_factory(model)) if lm else None
    ids = prompt_ids(model, workload.batch_size, workload.input_len)
    recorder = _Recorder(model, sync=model_device(model).type == "cuda")
    runs = workload.warmup + workload.repeats
    plain: dict[str, list[float]] = defaultdict(list)
    hooked: dict[str, list[dict[str, float]]] = defaultdict(list)
    counted: dict[str, dict[str, dict[str, int]]] = {}
    noop: Callable[[str], None] = lambda phase: None  # noqa: E731

    def keep_times(phase: str) -> None:
        hooked[phase].append(dict(recorder.self_s))

    def keep_counts(phase: str) -> None:
        counted[phase] = {"act": dict(recorder.act), "ops": dict(recorder.ops), "written": dict(recorder.written)}

    def report(done: int, what: str) -> None:
        if progress:
            progress(done, 2 * runs + 1, what)

    try:
        with torch.inference_mode():
            recorder.calibrate()
            recorder.timing = True
            for index in range(runs):
                plain_s = _run_phases(model, ids, factory, noop, noop)  # no hooks attached: the real latency
                recorder.attach()
                _run_phases(model, ids, factory, lambda _: recorder.reset(), keep_times)
                recorder.detach()
                if index >= workload.warmup:
                    for phase, seconds in plain_s.items():
                        if seconds is not None:
                            plain[phase].append(seconds)
                else:  # the warm-up's hooked times are dropped too
                    hooked.clear()
                report(2 * index + 2, "profile warm-up" if index < workload.warmup else "profile")
            recorder.attach()
            recorder.timing, recorder.counting = False, True
            # no_grad, not inference_mode: there composite ops (linear, sdpa) reach the dispatch mode
            # already decomposed into the kernels that really run (t + mm, the CPU flash kernel).
            with torch.inference_mode(False), torch.no_grad(), _OpCounter(recorder):
                _run_phases(model, ids, factory, lambda _: recorder.reset(), keep_counts)
            report(2 * runs + 1, "profile ops")
    finally:
        recorder.detach()
    return _document(model, workload, plain, hooked, counted, top, max_modules)


# -- the document -------------------------------------------------------------------------------
def _median_self_ms(runs: list[dict[str, float]], plain_ms: float) -> dict[str, float]:
    """Median self time per module, rescaled so the modules add up to the unhooked total."""
    names = {name for run in runs for name in run}
    medians = {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}
    medians = {name: max(0.0, value) for name, value in medians.items()}
    total = sum(medians.values())
    return {name: value / total * plain_ms if total > 0 else 0.0 for name, value in medians.items()}


def _outermost_of_role(name: str, roles: dict[str, str], called: set[str]) -> bool:
    """True unless the nearest called ancestor has the same role (its outputs already count)."""
    if not name:
        return False  # the root's output is the logits, already the lm_head's
    parent = name
    while parent:
        parent = parent.rpartition(".")[0]
        if parent and parent in called:
            return roles[parent] != roles[name]
    return True


def _document(model: nn.Module, workload: ProfileWorkload, plain: dict[str, list[float]],
              hooked: dict[str, list[dict[str, float]]], counted: dict[str, dict[str, dict[str, int]]],
              top: int, max_modules: int) -> dict[str, Any]:
    roles = module_roles(model)
    weights = weight_bytes_by_module(model)
    active = [p for p in PHASES if plain.get(p)]
    total_ms = {p: statistics.median(plain[p]) * 1000 for p in active}
    self_ms = {p: _median_self_ms(hooked[p], total_ms[p]) for p in active}
    # Workload time: one prefill plus output_len decode steps.
    weight = {"prefill": 1.0, "decode": float(workload.output_len)}
    grand = sum(weight[p] * total_ms[p] for p in active) or 1.0

    modules = []
    for name, role in roles.items():
        ms = {p: self_ms[p].get(name, 0.0) for p in active}
        if not any(ms.values()) and not weights.get(name):
            continue
        modules.append({
            "name": name or "<root>", "role": role,
            **{f"{p}_ms": round(ms.get(p, 0.0), 4) for p in PHASES},
            "param_bytes": weights.get(name, 0),
            "act_bytes": {p: counted[p]["act"].get(name, 0) for p in active},
            "ops": {p: counted[p]["ops"].get(name, 0) for p in active},
            "share": round(sum(weight[p] * ms[p] for p in active) / grand, 5),
        })
    modules.sort(key=lambda m: (-m["share"], m["name"]))

    groups: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        members = [n for n, r in roles.items() if r == role]
        ms = {p: sum(self_ms[p].get(n, 0.0) for n in members) for p in active}
        acts = {}
        for p in active:
            called = set(counted[p]["act"])
            acts[p] = sum(counted[p]["act"].get(n, 0) for n in members if _outermost_of_role(n, roles, called))
        groups[role] = {
            "share": round(sum(weight[p] * ms[p] for p in active) / grand, 5),
            **{f"{p}_ms": round(ms.get(p, 0.0), 4) for p in PHASES},
            "param_bytes": sum(weights.get(n, 0) for n in members),
            "act_bytes": acts,
            "written_bytes": {p: sum(counted[p]["written"].get(n, 0) for n in members) for p in active},
            "ops": {p: sum(counted[p]["ops"].get(n, 0) for n in members) for p in active},
        }

    def phase(p: str) -> dict[str, Any] | None:
        if p not in active:
            return None
        by_role = {role: groups[role][f"{p}_ms"] for role in ROLES}
        return {"batch_size": workload.batch_size, "tokens": 1 if p == "decode" else workload.input_len,
                "cache_len": workload.input_len if p == "decode" else 0,
                "ms": round(total_ms[p], 4), "hooked_ms": round(statistics.median(sum(r.values()) for r in hooked[p])
                                                                * 1000, 4),
                "ops": sum(counted[p]["ops"].values()), "written_bytes": sum(counted[p]["written"].values()),
                "ms_by_role": by_role,
                "shares": {r: round(ms / total_ms[p], 5) if total_ms[p] else 0.0 for r, ms in by_role.items()}}

    return {
        "prefill": phase("prefill"),
        "decode": phase("decode"),
        "groups": groups,
        "hotspots": [{k: m[k] for k in ("name", "role", "share")} for m in modules[:top]],
        "modules": modules[:max_modules],
        "modules_left_out": max(0, len(modules) - max_modules),
        "ops": {p: sum(counted[p]["ops"].values()) for p in active},
        "param_bytes": sum(weights.values()),
        "workload": asdict(workload),
        "device": str(model_device(model)), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "notes": [] if "decode" in active else
        [f"{type(model).__name__} has no KV-cache interface (cache, start_pos, last_only): prefill only"],
    }


def summary_line(profile: dict[str, Any], limit: int = 4) -> str:
    """'experts 67 %, attention 18 %, ...' — the biggest roles by workload share."""
    ranked = sorted(profile["groups"].items(), key=lambda kv: -kv[1]["share"])
    return ", ".join(f"{role} {g['share'] * 100:.0f} %" for role, g in ranked[:limit] if g["share"] > 0)


def profile_metrics(profile: dict[str, Any]) -> dict[str, float]:
    """The stage's metrics: phase times, op counts and ``share_<role>`` for every role (0 if absent)."""
    out: dict[str, float] = {}
    for phase in PHASES:
        if profile.get(phase):
            out[f"profile_{phase}_ms"] = profile[phase]["ms"]
            out[f"profile_ops_{phase}"] = profile["ops"][phase]
    out.update({f"share_{role}": profile["groups"][role]["share"] for role in ROLES})
    return out
