"""KV caches for the engine: a protocol, the growing baseline, and a registry of kinds.

A cache is chosen by a small config dict, ``{"kind": "growing", ...options}``. The default is the
growing cache (``torch.cat`` per step, what eager PyTorch code usually does). Another kind — a
preallocated or pooled cache written by a kv_config stage — registers itself with
``@register_cache("name", provider_module=...)`` and is then picked up from the model state's
recipe: a recipe step ``{"kind": "kv_cache", "cache": {"kind": "name", ...}}`` (build it with
``kv_cache_step``). The engine reads the last such step (``cache_config_from_recipe``). A config
may name the module that registers its kind, ``{"kind": "name", "provider": "pkg.module"}``, so a
fresh worker process that never imported it can still build the cache.

Kinds: ``growing`` (here), ``pooled`` (opus.kv.pool), ``static`` with compiled decode steps
(opus.kv.static), and ``by_batch``, a per-batch-size choice among them (what kv_config writes
when the fastest cache differs between batch sizes).

Model interface: attention in layer i calls ``k_all, v_all = cache.update(i, k, v)`` with ``k, v``
of shape ``[B, num_kv_heads, T, head_dim]`` and attends to everything returned, ``[B, H, S, D]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from opus import moved
from opus.recipe import register_transform

DEFAULT_KIND = "growing"
RECIPE_KIND = "kv_cache"


@runtime_checkable
class KVCache(Protocol):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v`` ([B, H, T, D]) for ``layer``; return everything stored for it ([B, H, S, D])."""
        ...

    @property
    def seq_len(self) -> int:
        """Positions held by every layer (i.e. committed by complete forward passes)."""
        ...

    def reset(self) -> None:
        """Forget everything (the cache can be reused for a new batch of the same shape)."""
        ...


@dataclass(frozen=True)
class CacheShape:
    """What a cache kind may need to allocate up front; ``None`` where the model does not say."""

    batch_size: int
    max_seq_len: int
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    device: torch.device
    dtype: torch.dtype


class GrowingKVCache:
    """The baseline: one tensor per layer, grown with ``torch.cat`` on every update.

    Simple and shape-agnostic, but each decode step copies the whole cache once per layer — the
    cost a preallocated cache removes.
    """

    def __init__(self, num_layers: int | None = None) -> None:
        self.num_layers = num_layers
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self._k:
            self._k[layer] = torch.cat((self._k[layer], k), dim=2)
            self._v[layer] = torch.cat((self._v[layer], v), dim=2)
        else:
            self._k[layer], self._v[layer] = k, v
        return self._k[layer], self._v[layer]

    @property
    def seq_len(self) -> int:
        # Mid-forward, early layers already hold the new tokens; the minimum is what all layers hold.
        if not self._k or (self.num_layers is not None and len(self._k) < self.num_layers):
            return 0
        return min(t.shape[2] for t in self._k.values())

    def reset(self) -> None:
        self._k.clear()
        self._v.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))


CacheBuilder = Callable[[dict[str, Any], CacheShape], KVCache]
CacheFactory = Callable[[int, int], KVCache]  # (batch_size, max_seq_len) -> a fresh cache

_KINDS: dict[str, CacheBuilder] = {}
_PROVIDERS: dict[str, str] = {}  # kind -> module that registers it on import


def register_cache(kind: str, provider_module: str | None = None) -> Callable[[CacheBuilder], CacheBuilder]:
    """Register a builder ``(options, shape) -> KVCache`` under ``kind``.

    ``provider_module`` lets a process that never imported the provider find it later (the
    registration itself must then be importable from that module).
    """

    def decorator(fn: CacheBuilder) -> CacheBuilder:
        _KINDS[kind] = fn
        return fn

    if provider_module:
        _PROVIDERS[kind] = provider_module
    return decorator


def known_kinds() -> list[str]:
    return sorted(set(_KINDS) | set(_PROVIDERS))


@register_cache(DEFAULT_KIND)
def _growing(options: dict[str, Any], shape: CacheShape) -> KVCache:
    if options:
        raise ValueError(f"the growing KV cache takes no options (got {', '.join(sorted(options))})")
    return GrowingKVCache(shape.num_layers)


def _model_attr(model_config: Any, name: str) -> int | None:
    value = getattr(model_config, name, None) if model_config is not None else None
    return int(value) if isinstance(value, int) else None


def _builder(kind: str, provider: str | None) -> CacheBuilder:
    if kind not in _KINDS and (provider or kind in _PROVIDERS):
        moved.import_module(provider or _PROVIDERS[kind])
    if kind not in _KINDS:
        raise ValueError(f"unknown KV cache kind '{kind}' (known: {', '.join(known_kinds())})")
    return _KINDS[kind]


def make_cache(config: dict[str, Any] | None, model_config: Any, batch_size: int, max_seq_len: int,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> KVCache:
    """Build a cache of ``config["kind"]`` (default: growing) for one batch."""
    shape = CacheShape(batch_size=batch_size, max_seq_len=max_seq_len,
                       num_layers=_model_attr(model_config, "num_layers"),
                       num_kv_heads=_model_attr(model_config, "num_kv_heads"),
                       head_dim=_model_attr(model_config, "head_dim"),
                       device=torch.device(device), dtype=dtype)
    return build_cache(config, shape)


def build_cache(config: dict[str, Any] | None, shape: CacheShape) -> KVCache:
    options = dict(config or {})
    kind = options.pop("kind", DEFAULT_KIND)
    return _builder(kind, options.pop("provider", None))(options, shape)


BY_BATCH = "by_batch"


def by_batch_config(rules: list[tuple[int | None, dict[str, Any]]]) -> dict[str, Any]:
    """A cache chosen by batch size: ``[(up_to, config), ..., (None, config)]``, first match wins."""
    return {"kind": BY_BATCH, "rules": [{"cache": dict(c)} if up_to is None else {"up_to": up_to, "cache": dict(c)}
                                        for up_to, c in rules]}


def describe_cache(config: dict[str, Any] | None) -> str:
    """One line for people: ``static, compiled decode up to batch 1; pooled above``."""
    config = config or {}
    kind = config.get("kind", DEFAULT_KIND)
    if kind == BY_BATCH:
        rules = config.get("rules") or []
        parts = [f"{describe_cache(r.get('cache'))} up to batch {r['up_to']}" for r in rules if "up_to" in r]
        return "; ".join([*parts, f"{describe_cache(rules[-1].get('cache'))} above"]) if rules else kind
    if kind == "static" and config.get("compile", True):
        return "static, compiled decode"
    return str(kind)


@register_cache(BY_BATCH)
def _by_batch(options: dict[str, Any], shape: CacheShape) -> KVCache:
    """What a kv_config stage writes when the fastest cache differs between batch sizes (e.g. a
    compiled static cache at batch 1, a pooled one at batch 32)."""
    rules = options.get("rules")
    if set(options) != {"rules"} or not isinstance(rules, list) or not rules:
        raise ValueError("the by_batch KV cache takes one option, rules: a list of {up_to, cache}, "
                         "the last without up_to")
    for i, rule in enumerate(rules):
        last = i == len(rules) - 1
        if not isinstance(rule, dict) or "cache" not in rule or ("up_to" in rule) == last:
            raise ValueError(f"by_batch rule {i}: expected {{up_to: N, cache: {{...}}}}, "
                             f"{'the last without' if last else 'with'} up_to; got {rule!r}")
        kind = rule["cache"].get("kind", DEFAULT_KIND)
        _builder(kind, rule["cache"].get("provider"))  # an unknown kind fails now, at any batch size
    return build_cache(cache_for_batch(options | {"kind": BY_BATCH}, shape.batch_size), shape)


def cache_for_batch(config: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The cache a config runs at ``batch_size``: a by_batch config's first matching rule, else itself."""
    if config.get("kind") != BY_BATCH:
        return config
    for rule in config["rules"]:
        if "up_to" not in rule or batch_size <= rule["up_to"]:
            return rule["cache"]
    raise AssertionError("unreachable: the last rule matches every batch size")


def cache_factory(model: torch.nn.Module, config: dict[str, Any] | None = None) -> CacheFactory:
    """A factory of fresh caches matched to ``model`` (its config, device and dtype)."""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    model_config = getattr(model, "config", None)
    make_cache(config, model_config, 1, 1, device, dtype)  # fail now on a bad config, not mid-measurement

    def factory(batch_size: int, max_seq_len: int) -> KVCache:
        return make_cache(config, model_config, batch_size, max_seq_len, device, dtype)

    return factory


# -- the recipe ---------------------------------------------------------------------------------
def kv_cache_step(config: dict[str, Any]) -> dict[str, Any]:
    """The recipe step a kv_config stage appends: ``{"kind": "kv_cache", "cache": config}``."""
    return {"kind": RECIPE_KIND, "cache": dict(config)}


def cache_config_from_recipe(recipe: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The cache config of the last ``kv_cache`` step, or None (the growing default)."""
    steps = [s for s in recipe or [] if s.get("kind") == RECIPE_KIND]
    return dict(steps[-1].get("cache") or {}) if steps else None


@register_transform(RECIPE_KIND, provider_module="opus.kv.cache")
def _apply_kv_cache_step(model: Any, step: dict[str, Any]) -> Any:
    """A KV cache choice changes no weights: rebuilding a state only checks the kind can be built."""
    config = step.get("cache") or {}
    _builder(config.get("kind", DEFAULT_KIND), config.get("provider"))
    return model
