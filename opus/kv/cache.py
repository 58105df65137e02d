"""KV caches for the engine: the protocol, the growing baseline, and the registry of kinds.

A cache is chosen by a small config dict, ``{"kind": "growing", ...options}``. The default is the
growing cache (``torch.cat`` per step, what eager PyTorch code usually does). Every other kind is one
module of this package that registers one ``CacheKind`` object with ``register_kind``: how to build
it (``build``), how many sequences fit a memory budget (``max_batch``), one line for people
(``describe``), the configs a kv_config stage measures (``candidates``) and why it cannot run for a
model (``unavailable``). ``opus/kv/__init__.py`` imports each such module, which both registers
the kind and puts its code in every stage key (opus.pipeline.code_reach follows imports only).

A recipe step ``{"kind": "kv_cache", "cache": {"kind": "name", ...}}`` (opus.kv.choice) selects
the cache; the engine reads the last such step (``cache_config_from_recipe``). A config may name the
module that registers its kind, ``{"kind": "name", "provider": "pkg.module"}``, so a kind from
outside Opus is found by a fresh worker process too (old module paths resolve through opus.moved).

Kinds: ``growing`` (here), ``pooled`` (opus.kv.pool), ``static`` with compiled decode steps
(opus.kv.static), ``cuda_graph``, static with CUDA-graph decode steps (opus.kv.cuda_graph), and
``by_batch``, a per-batch-size choice among them (what kv_config writes when the fastest cache
differs between batch sizes).

Model interface: attention in layer i calls ``k_all, v_all = cache.update(i, k, v)`` with ``k, v``
of shape ``[B, num_kv_heads, T, head_dim]`` and attends to everything returned, ``[B, H, S, D]``,
masked by ``cache.mask`` where that is not None. A cache whose ``decodes_itself`` is True gets each
one-token step through ``decode_step`` instead. ``CacheBase`` gives the hooks their defaults, so the
decoder reads them directly and never probes a cache with ``hasattr``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from opus import moved
from opus.trust import UntrustedCode

DEFAULT_KIND = "growing"
BY_BATCH = "by_batch"


@runtime_checkable
class KVCache(Protocol):
    # True: the model hands each one-token decode step to ``decode_step`` (a static cache runs it as
    # one compiled or captured graph); False: it calls ``update`` per layer like any other forward.
    decodes_itself: bool
    # Set only on the view a cache's own decode step passes to the model: the key mask over every
    # slot and the step's positions as a tensor (a compiled step never specializes on the position).
    mask: torch.Tensor | None
    positions: torch.Tensor | None
    # True: a prefill from position 0 goes to ``prefill_step`` (opus.kv.static compiles it padded to a
    # bucket); ``last_index`` is set only on the view that step passes: where the last real token is.
    prefills_itself: bool
    last_index: torch.Tensor | None
    # The attention kernel the model runs with this cache: "sdpa", "blocked" or "blocked_bf16"
    # (opus.models.attention).
    attention: str

    def stored_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer``'s K and V scales when ``update`` returned int8 bytes for attention to read as stored (a
        static cache's decode step, opus.models.int8_kv); None otherwise."""
        ...

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

    def decode_step(self, model: torch.nn.Module, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of one token per row at ``start_pos``; called only if ``decodes_itself``."""
        ...

    def prefill_step(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of the prompt's last token from position 0; called only if ``prefills_itself``."""
        ...


class CacheBase:
    """The protocol's optional hooks with their defaults: a subclass writes update, seq_len and reset."""

    decodes_itself: ClassVar[bool] = False
    prefills_itself: bool = False
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    last_index: torch.Tensor | None = None
    attention: str = "sdpa"

    def stored_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def decode_step(self, model: torch.nn.Module, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not run decode steps (decodes_itself is False)")

    def prefill_step(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not run prefills (prefills_itself is False)")


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


class GrowingKVCache(CacheBase):
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

    def repeated(self, rows: int) -> GrowingKVCache:
        """A copy whose ``rows`` rows each hold this one-row cache: several continuations of one prefix."""
        copy = GrowingKVCache(self.num_layers)
        for layer in self._k:
            copy._k[layer] = self._k[layer].expand(rows, -1, -1, -1).contiguous()
            copy._v[layer] = self._v[layer].expand(rows, -1, -1, -1).contiguous()
        return copy


# -- the registry of kinds ---------------------------------------------------------------------------
CacheBuilder = Callable[[dict[str, Any], CacheShape], KVCache]
CacheFactory = Callable[[int, int], KVCache]  # (batch_size, max_seq_len) -> a fresh cache


class CacheKind(Protocol):
    """What every kind registers: one object, asked by the engine and the kv_config stage alike."""

    name: str
    provider: str | None  # the module that registers it (written into configs, so workers find it)
    simplicity: int  # between kinds tied within the noise, the lower (less machinery) wins

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache: ...

    def max_batch(self, budget_bytes: int, per_token_bytes: int, context_len: int, options: dict[str, Any]) -> int:
        """The most sequences of ``context_len`` positions whose caches, as allocated, fit ``budget_bytes``."""
        ...

    def describe(self, options: dict[str, Any]) -> str: ...

    def candidates(self, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """Configs (kind and provider included) a kv_config stage with ``settings`` measures."""
        ...

    def unavailable(self, model: torch.nn.Module, options: dict[str, Any]) -> str | None:
        """Why this config cannot run for ``model`` here (kv_config reports it skipped), or None."""
        ...


class KindBase:
    """Defaults of ``CacheKind``: measured by no stage, runs everywhere, described by its name."""

    name: str = ""
    provider: str | None = None
    simplicity: int = 100
    OPTIONS: tuple[str, ...] | None = None  # the options build takes; None: not checked

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache:
        raise NotImplementedError

    def check_options(self, options: dict[str, Any]) -> None:
        """A misspelt option fails by name instead of being ignored."""
        unknown = set(options) - set(self.OPTIONS or options)
        if unknown:
            raise ValueError(f"the {self.name} KV cache has no option {', '.join(sorted(unknown))} "
                             f"(it takes {', '.join(self.OPTIONS or ())})")

    def max_batch(self, budget_bytes: int, per_token_bytes: int, context_len: int, options: dict[str, Any]) -> int:
        # Unknown allocation: assume it holds the context plus a transient copy, like the growing cache.
        return max(0, budget_bytes // (2 * per_token_bytes * context_len))

    def describe(self, options: dict[str, Any]) -> str:
        return self.name

    def simplicity_of(self, options: dict[str, Any]) -> int:
        """The rank of one config of this kind (a kind's options may add machinery)."""
        return self.simplicity

    def candidates(self, settings: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def unavailable(self, model: torch.nn.Module, options: dict[str, Any]) -> str | None:
        return None

    def config(self, **options: Any) -> dict[str, Any]:
        """A config of this kind, with the provider a fresh process imports to find it."""
        return {"kind": self.name, **({"provider": self.provider} if self.provider else {}), **options}


class _BuilderKind(KindBase):
    """A kind registered as a bare builder function (``register_cache``): built, never measured."""

    def __init__(self, name: str, builder: CacheBuilder, provider: str | None) -> None:
        self.name, self.provider, self._builder = name, provider, builder

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache:
        return self._builder(options, shape)


_KINDS: dict[str, CacheKind] = {}
_PROVIDERS: dict[str, str] = {}  # kind -> module that registers it on import


def register_kind(kind: CacheKind) -> CacheKind:
    """Register ``kind`` under ``kind.name`` (the module defining it must be importable as ``kind.provider``)."""
    _KINDS[kind.name] = kind
    if kind.provider:
        _PROVIDERS[kind.name] = kind.provider
    return kind


def register_cache(kind: str, provider_module: str | None = None) -> Callable[[CacheBuilder], CacheBuilder]:
    """Register a bare builder ``(options, shape) -> KVCache`` under ``kind`` (built, never measured)."""

    def decorator(fn: CacheBuilder) -> CacheBuilder:
        register_kind(_BuilderKind(kind, fn, provider_module))
        return fn

    if provider_module:
        _PROVIDERS[kind] = provider_module
    return decorator


def known_kinds() -> list[str]:
    return sorted(set(_KINDS) | set(_PROVIDERS))


def registered_kinds() -> list[CacheKind]:
    """Every kind registered in this process, the simplest first (Opus's own: see opus/kv/__init__.py)."""
    return sorted(_KINDS.values(), key=lambda k: (k.simplicity, k.name))


def kind_of(kind: str, provider: str | None = None) -> CacheKind:
    """The registered kind ``kind``, importing ``provider`` (or its known provider) first if needed."""
    if kind not in _KINDS and (provider or kind in _PROVIDERS):
        moved.import_module(provider or _PROVIDERS[kind], f"the provider of the KV cache kind {kind!r}")
    if kind not in _KINDS:
        raise ValueError(f"unknown KV cache kind '{kind}' (known: {', '.join(known_kinds())})")
    return _KINDS[kind]


def _builder(kind: str, provider: str | None) -> CacheBuilder:
    return kind_of(kind, provider).build


class _GrowingKind(KindBase):
    name, provider, simplicity = DEFAULT_KIND, None, 0

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache:
        if options:
            raise ValueError(f"the growing KV cache takes no options (got {', '.join(sorted(options))})")
        return GrowingKVCache(shape.num_layers)

    def max_batch(self, budget_bytes: int, per_token_bytes: int, context_len: int, options: dict[str, Any]) -> int:
        # Holds exactly the context, plus a transient copy of a layer while ``torch.cat`` grows it.
        return max(0, budget_bytes // (2 * per_token_bytes * context_len))

    def candidates(self, settings: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"kind": DEFAULT_KIND}] if settings.get("include_growing", True) else []


register_kind(_GrowingKind())


def _model_attr(model_config: Any, name: str) -> int | None:
    value = getattr(model_config, name, None) if model_config is not None else None
    return int(value) if isinstance(value, int) else None


def make_cache(config: dict[str, Any] | None, model_config: Any, batch_size: int, max_seq_len: int,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> KVCache:
    """Build a cache of ``config["kind"]`` (default: growing) for one batch."""
    shape = CacheShape(batch_size=batch_size, max_seq_len=max_seq_len,
                       num_layers=_model_attr(model_config, "num_layers"),
                       num_kv_heads=_model_attr(model_config, "num_kv_heads"),
                       head_dim=_model_attr(model_config, "head_dim"),
                       device=torch.device(device), dtype=dtype)
    return build_cache(config, shape)


def _split(config: dict[str, Any] | None) -> tuple[str, str | None, dict[str, Any]]:
    """A cache config as (its kind's name, its provider, the kind's own options)."""
    options = dict(config or {})
    return options.pop("kind", DEFAULT_KIND), options.pop("provider", None), options


def build_cache(config: dict[str, Any] | None, shape: CacheShape) -> KVCache:
    kind, provider, options = _split(config)
    cache = kind_of(kind, provider).build(options, shape)
    # The decoder reads the hooks without probing: a cache lacking them fails here, by name.
    if not isinstance(cache, KVCache):
        raise TypeError(f"KV cache kind '{kind}' built a {type(cache).__name__}, which lacks the KVCache hooks "
                        "(decodes_itself, mask, positions, decode_step): derive it from opus.kv.cache.CacheBase")
    return cache


def by_batch_config(rules: list[tuple[int | None, dict[str, Any]]]) -> dict[str, Any]:
    """A cache chosen by batch size: ``[(up_to, config), ..., (None, config)]``, first match wins."""
    return {"kind": BY_BATCH, "rules": [{"cache": dict(c)} if up_to is None else {"up_to": up_to, "cache": dict(c)}
                                        for up_to, c in rules]}


def describe_cache(config: dict[str, Any] | None) -> str:
    """One line for people: ``static, compiled decode up to batch 1; pooled above``."""
    kind, provider, options = _split(config)
    try:
        return kind_of(kind, provider).describe(options)
    except (ValueError, ImportError, UntrustedCode):  # a kind this process cannot (or may not) load is still named
        return str(kind)


def cache_for_batch(config: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The cache a config runs at ``batch_size``: a by_batch config's first matching rule, else itself."""
    if config.get("kind") != BY_BATCH:
        return config
    for rule in config["rules"]:
        if "up_to" not in rule or batch_size <= rule["up_to"]:
            return rule["cache"]
    raise AssertionError("unreachable: the last rule matches every batch size")


class _ByBatchKind(KindBase):
    """What a kv_config stage writes when the fastest cache differs between batch sizes (e.g. a
    compiled static cache at batch 1, a pooled one at batch 32). Never a candidate itself."""

    name, provider, simplicity = BY_BATCH, None, 99

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache:
        rules = options.get("rules")
        if set(options) != {"rules"} or not isinstance(rules, list) or not rules:
            raise ValueError("the by_batch KV cache takes one option, rules: a list of {up_to, cache}, "
                             "the last without up_to")
        for i, rule in enumerate(rules):
            last = i == len(rules) - 1
            if not isinstance(rule, dict) or "cache" not in rule or ("up_to" in rule) == last:
                raise ValueError(f"by_batch rule {i}: expected {{up_to: N, cache: {{...}}}}, "
                                 f"{'the last without' if last else 'with'} up_to; got {rule!r}")
            kind_of(rule["cache"].get("kind", DEFAULT_KIND), rule["cache"].get("provider"))  # unknown: fail now
        return build_cache(cache_for_batch(options | {"kind": BY_BATCH}, shape.batch_size), shape)

    def max_batch(self, budget_bytes: int, per_token_bytes: int, context_len: int, options: dict[str, Any]) -> int:
        # The rule a batch of that size would run decides; the largest batch any rule's own cache fits
        # and that the rule covers is the answer.
        best = 0
        for rule in options.get("rules") or []:
            kind, provider, cache = _split(rule["cache"])
            fits = kind_of(kind, provider).max_batch(budget_bytes, per_token_bytes, context_len, cache)
            best = max(best, min(fits, rule.get("up_to", fits)))
        return best

    def describe(self, options: dict[str, Any]) -> str:
        rules = options.get("rules") or []
        parts = [f"{describe_cache(r.get('cache'))} up to batch {r['up_to']}" for r in rules if "up_to" in r]
        return "; ".join([*parts, f"{describe_cache(rules[-1].get('cache'))} above"]) if rules else BY_BATCH

    def unavailable(self, model: torch.nn.Module, options: dict[str, Any]) -> str | None:
        rules = options.get("rules") or []
        reasons = [(rule.get("up_to"), why) for rule in rules if (why := unavailable_for(model, rule.get("cache")))]
        return "; ".join(f"{'above' if up_to is None else f'up to batch {up_to}'}: {why}"
                         for up_to, why in reasons) or None


register_kind(_ByBatchKind())


def unavailable_for(model: torch.nn.Module, config: dict[str, Any] | None) -> str | None:
    """Why ``config``'s cache cannot run as configured for ``model`` here (``CacheKind.unavailable``), or None."""
    kind, provider, options = _split(config)
    return kind_of(kind, provider).unavailable(model, options)


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
