"""A static KV cache whose decode steps run as one compiled graph: cache kind ``"static"``.

    {"kind": "static", "provider": "opus.kv.static", "compile": true, "slot_multiple": 128}

At batch 1 on a CPU a decode step is bound by per-op dispatch (about a thousand aten calls per K3
step), not by arithmetic. A step with static shapes can be compiled once into a single C++ function
(inductor with ``cpp_wrapper``) that calls the kernels directly. Shapes stay static because the cache
holds preallocated K and V buffers per layer (``[B, kv_heads, slots, head_dim]``); a decode step
writes its slot at a position *tensor* and attends to every slot through a ``slot <= position``
mask, so step 100 has the same shapes and the same graph as step 1. Slots are the request's length
rounded up to ``slot_multiple``, so nearby lengths share one compiled graph.

The engine is unchanged: the cache's ``decodes_itself`` is True, so ``DecoderLM.forward`` hands a
one-token step to its ``decode_step``, which runs the model through ``DecodeView`` (the same buffers, with ``positions``
and ``mask``) inside ``torch.compile``. Prefill runs eagerly through ``update`` (writes the first
slots in place and returns views of the filled ones). ``compile: false`` runs the same masked step
eagerly; a compile failure (no C++ compiler, an op inductor cannot lower) falls back to that too,
once per model, and says why in ``notes``.

``compile_prefill: true`` compiles the prefill as well (``prefills_itself``). Its shapes are made
static by padding the prompt to a bucket (the next power of two, at least ``MIN_PREFILL_BUCKET``,
at most the slots): the padded tokens come after the real ones, so causal attention keeps them out
of every real token's view, and the slots they fill lie beyond the cache's length, where decode steps
overwrite them before the mask lets anything see them. The logits are those of the last *real*
token (``PrefillView.last_index``). One graph per (batch, bucket, slots); a compile failure runs the
same padded prefill eagerly, with the reason in ``notes``.

``attention: blocked`` runs the causal prefill's attention through Opus's own kernel
(``opus.models.attention``: query blocks that skip the keys after them) instead of torch's SDPA;
compiled graphs are kept per kernel. ``kv_dtype: bfloat16`` (or ``float16``, or ``int8`` with a
scale per token and head: opus.kv.stored) keeps K and V narrower: a half or a quarter of the bytes a
decode step keeps; the step's masked attention then runs as two matmuls
(``opus.models.attention.narrow_kv_attention``) over the values widened, except that int8 K/V of a float32
model with head_dim 32, 64 or 128 is read as stored, bytes and scales, by ``opus.models.int8_kv`` (a C++ op;
the widened path serves where it does not build). A prompt attends to its own keys as computed. It is
lossy: kv_config measures its perplexity through the cache before it may race.

Each registered kernel choice (opus.kv.kernel_choices, declared by the quantization formats: W8A8's
``w8a8_weight_only_rows`` and ``w8a8_packed_gemm``) is an option of the same name: the compiled steps
are traced under its value (per phase where the value names phases), the eager steps keep the layers'
defaults. Which is faster depends on the CPU and the layers' sizes, so kv_config races the values its
``kernel_choices`` lists rather than assume one.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from opus.kv.cache import CacheBase, CacheShape, KindBase, KVCache, register_kind
from opus.kv.compiled_steps import Step, StepKey, Steps, compiled_once
from opus.kv.kernel_choices import KERNEL_CHOICES, check_value, choice
from opus.kv.stored import kv_dtype_of, scale_buffers, store, widened
from opus.models import int8_kv, native_attention
from opus.models.attention import BLOCKED_BF16, DOT, INT8_STORED, check_kernel

KIND = "static"
PROVIDER = "opus.kv.static"
DEFAULT_SLOT_MULTIPLE = 128
MIN_PREFILL_BUCKET = 16
_STEPS: Steps = weakref.WeakKeyDictionary()
_PREFILLS: Steps = weakref.WeakKeyDictionary()


def slots_for(tokens: int, slot_multiple: int) -> int:
    """Slots a request of ``tokens`` positions gets: rounded up to whole ``slot_multiple``s."""
    return -(-tokens // slot_multiple) * slot_multiple


def prefill_bucket(tokens: int, slots: int) -> int:
    """The padded length a compiled prefill of ``tokens`` runs at: a power of two, within ``slots``."""
    return min(slots, max(MIN_PREFILL_BUCKET, 1 << (tokens - 1).bit_length()))


def max_batch(budget_bytes: int, per_token_bytes: int, context_len: int, slot_multiple: int) -> int:
    """The most sequences of ``context_len`` positions whose static caches fit ``budget_bytes``."""
    return max(0, budget_bytes // (per_token_bytes * slots_for(context_len, slot_multiple)))


class _Slots(CacheBase):
    """Per-layer K/V buffers and, for int8 K/V, their scales (``2 × layers``: K's, then V's)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    scales: list[torch.Tensor]

    def _scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.scales:
            return None, None
        return self.scales[layer], self.scales[len(self.k) + layer]

    def _store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_scales, v_scales = self._scales(layer)
        store(self.k[layer], k_scales, slots, k)
        store(self.v[layer], v_scales, slots, v)

    def _read(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``end`` slots (all: None) of ``layer`` as attention reads them (int8 widened)."""
        cut = slice(None, end)
        k_scales, v_scales = self._scales(layer)
        return (widened(self.k[layer][:, :, cut], None if k_scales is None else k_scales[:, :, cut]),
                widened(self.v[layer][:, :, cut], None if v_scales is None else v_scales[:, :, cut]))

    def _narrow(self, layer: int, k: torch.Tensor) -> bool:
        return self.k[layer].dtype != k.dtype


class DecodeView(_Slots):
    """What the model sees during a compiled decode step: every slot, the position, the mask.

    One tensor per layer, not one for all layers: written in place through a view of a bigger
    buffer, the compiled step copied the whole cache each step (functionalization scatters the view
    back into its base); a whole graph input is updated in place. With int8 K/V the step's attention
    is ``int8_stored`` where the cache chose it (attention reads the int8 bytes and their scales,
    opus.models.int8_kv), else ``dot`` (opus.models.attention) over the widened slots.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], key_pos: torch.Tensor,
                 positions: torch.Tensor, attention: str = "sdpa", scales: list[torch.Tensor] | None = None) -> None:
        self.k, self.v, self.scales = k, v, scales or []
        self.attention = (attention if attention == INT8_STORED else DOT) if self.scales else attention
        self.positions: torch.Tensor | None = positions
        # [T, S]: slot s is visible to the token at p iff s <= p.
        self.mask: torch.Tensor | None = key_pos[None, :] <= positions[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.positions is not None
        self._store(layer, self.positions, k, v)
        if self.attention == INT8_STORED:
            return self.k[layer], self.v[layer]
        return self._read(layer)

    def stored_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer``'s K and V scales when attention reads the int8 bytes (``update`` returned them), else None."""
        k_scales, v_scales = self._scales(layer)
        return None if self.attention != INT8_STORED or k_scales is None or v_scales is None else (k_scales, v_scales)


class PrefillView(_Slots):
    """What the model sees during a compiled prefill from position 0: the first ``length`` slots of
    every layer (a static slice), causal attention, and the index of the last real token."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], length: int, last_index: torch.Tensor,
                 attention: str = "sdpa", scales: list[torch.Tensor] | None = None) -> None:
        self.k, self.v, self.length, self.attention, self.scales = k, v, length, attention, scales or []
        self.last_index: torch.Tensor | None = last_index
        self._slots = torch.arange(length, device=last_index.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_copy_ into the whole graph input, not copy_ into a slice: the slice's write-back
        # would copy every slot of the layer.
        self._store(layer, self._slots, k, v)
        if self._narrow(layer, k):  # the prompt attends to its keys as computed (each slot it has just written)
            return k, v
        return self._read(layer, self.length)


class CompiledStaticKVCache(_Slots):
    """Preallocated K/V for every layer; eager ``update`` for prefill, ``decode_step`` (one compiled
    graph, or the same step eagerly) for decoding."""

    decodes_itself = True

    def __init__(self, shape: CacheShape, compile_decode: bool = True,
                 slot_multiple: int = DEFAULT_SLOT_MULTIPLE, compile_prefill: bool = False,
                 attention: str = "sdpa", kv_dtype: str | None = None,
                 kernels: dict[str, Any] | None = None) -> None:
        if None in (shape.num_layers, shape.num_kv_heads, shape.head_dim):
            raise ValueError("the static KV cache needs the model's num_layers, num_kv_heads and head_dim")
        slots = slots_for(shape.max_seq_len, slot_multiple)
        dims = (shape.batch_size, shape.num_kv_heads, slots, shape.head_dim)
        dtype = kv_dtype_of(kv_dtype, shape.dtype)
        self.k = [torch.zeros(dims, device=shape.device, dtype=dtype) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(dims, device=shape.device, dtype=dtype) for _ in range(shape.num_layers)]
        self.scales = scale_buffers(dims, int(shape.num_layers), dtype, shape.dtype, shape.device)
        self.key_pos = torch.arange(slots, device=shape.device)
        self.position = torch.zeros(1, dtype=torch.long, device=shape.device)
        self.compile_decode = compile_decode
        self.prefills_itself = compile_prefill
        self.attention = check_kernel(attention)
        self.decode_attention = self.attention if not self.scales else decode_attention_over_int8(shape)
        # option -> value of the kernel choices the compiled steps are traced under
        self.kernels = {option: check_value(option, value) for option, value in (kernels or {}).items()
                        if value is not None}
        self._last = torch.zeros(1, dtype=torch.long, device=shape.device)
        self._lens = [0] * int(shape.num_layers)

    @property
    def slots(self) -> int:
        return int(self.k[0].shape[2])

    @property
    def seq_len(self) -> int:
        return min(self._lens)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._lens[layer], self._lens[layer] + k.shape[2]
        self._check(end, k.shape[0])
        self._store(layer, self.key_pos[start:end], k, v)
        self._lens[layer] = end
        if start == 0 and self._narrow(layer, k):  # as PrefillView: the prompt's keys as computed
            return k, v
        return self._read(layer, end)

    def decode_step(self, model: nn.Module, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of one new token per row at ``start_pos`` (the next free slot)."""
        if start_pos != self.seq_len:
            raise ValueError(f"decode at position {start_pos}, but the static KV cache holds {self.seq_len}")
        self._check(start_pos + 1, input_ids.shape[0])
        self.position.fill_(start_pos)
        out = self._run_step(model, input_ids)
        self._lens = [start_pos + 1] * len(self._lens)
        return out

    def prefill_step(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of the prompt's last token: the prompt padded to its bucket, compiled."""
        if self.seq_len:
            raise ValueError(f"prefill from position 0, but the static KV cache holds {self.seq_len}")
        tokens = input_ids.shape[1]
        self._check(tokens, input_ids.shape[0])
        length = prefill_bucket(tokens, self.slots)
        padded = torch.nn.functional.pad(input_ids, (0, length - tokens))  # token 0: never seen, overwritten
        self._last.fill_(tokens - 1)
        attention = self.attention
        prefill = (compiled_prefill(model, attention, self.step_settings("prefill")) if self.compile_decode
                   else eager_prefill(model, attention))
        out = prefill(padded, self._last, self.k, self.v, self.scales)
        self._lens = [tokens] * len(self._lens)
        return out

    def _run_step(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """The step itself, ``self.position`` already set (opus.kv.cuda_graph captures it instead)."""
        step = (compiled_step(model, self.decode_attention, self.step_settings("decode")) if self.compile_decode
                else eager_step(model, self.decode_attention))
        return step(input_ids, self.position, self.k, self.v, self.key_pos, self.scales)

    def step_settings(self, phase: str) -> StepKey:
        """The kernel settings this cache's compiled ``phase`` (prefill or decode) is traced under."""
        in_phase = ((option, choice(option).in_phase(value, phase)) for option, value in self.kernels.items())
        return tuple((option, value) for option, value in in_phase if value is not None)

    def _check(self, end: int, batch: int) -> None:
        if end > self.slots:
            raise ValueError(f"{end} positions exceed the static KV cache's {self.slots} slots")
        if batch != self.k[0].shape[0]:
            raise ValueError(f"batch {batch} does not match the static KV cache's {self.k[0].shape[0]}")

    def reset(self) -> None:
        self._lens = [0] * len(self._lens)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.scales))


def decode_attention_over_int8(shape: CacheShape) -> str:
    """How a decode step reads int8 K/V: their bytes (opus.models.int8_kv) where that op builds and takes the
    model's dtype and head_dim, else widened (``dot``)."""
    if (shape.dtype != torch.float32 or shape.head_dim not in int8_kv.HEAD_DIMS
            or torch.device(shape.device).type != "cpu"):
        return DOT
    return INT8_STORED if int8_kv.load() is None else DOT


def eager_step(model: nn.Module, attention: str = "sdpa") -> Step:
    def step(ids: torch.Tensor, positions: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
             key_pos: torch.Tensor, scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        return model(ids, cache=DecodeView(k, v, key_pos, positions, attention, scales), last_only=True)

    return step


def eager_prefill(model: nn.Module, attention: str = "sdpa") -> Step:
    def prefill(ids: torch.Tensor, last_index: torch.Tensor, k: list[torch.Tensor],
                v: list[torch.Tensor], scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        view = PrefillView(k, v, ids.shape[1], last_index, attention, scales)
        return model(ids, cache=view, start_pos=0, last_only=True)

    return prefill


def compiled_step(model: nn.Module, attention: str = "sdpa", settings: StepKey = ()) -> Step:
    """The model's decode step compiled (once per model, attention kernel and kernel settings;
    inductor recompiles per batch and slot count)."""
    return compiled_once(model, attention, settings, _STEPS, eager_step, "decode step")


def compiled_prefill(model: nn.Module, attention: str = "sdpa", settings: StepKey = ()) -> Step:
    """The model's padded prefill compiled (once per model, attention kernel and kernel settings;
    recompiled per batch, bucket and slot count)."""
    return compiled_once(model, attention, settings, _PREFILLS, eager_prefill, "prefill")


def slot_multiple_of(options: dict[str, Any]) -> int:
    multiple = options.get("slot_multiple", DEFAULT_SLOT_MULTIPLE)
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"slot_multiple must be a positive integer, got {multiple!r}")
    return multiple


def decoder_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot hand its decode steps to a cache: only Opus's decoder does (DecoderLM.forward)."""
    from opus.models.decoder import DecoderLM

    return None if isinstance(model, DecoderLM) else (
        f"{type(model).__name__} is not an Opus decoder, which alone hands decode steps to the cache")


class _StaticKind(KindBase):
    name, provider, simplicity = KIND, PROVIDER, 2
    BASE_OPTIONS = ("compile", "slot_multiple", "compile_prefill", "attention", "kv_dtype")

    @property
    def OPTIONS(self) -> tuple[str, ...]:  # type: ignore[override]  # noqa: N802 - KindBase's name
        return self.BASE_OPTIONS + tuple(KERNEL_CHOICES)

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache:
        self.check_options(options)
        return CompiledStaticKVCache(shape, bool(options.get("compile", True)), slot_multiple_of(options),
                                     bool(options.get("compile_prefill", False)), options.get("attention", "sdpa"),
                                     options.get("kv_dtype"), _kernels(options))

    def max_batch(self, budget_bytes: int, per_token_bytes: int, context_len: int, options: dict[str, Any]) -> int:
        # The context rounded up to whole slot multiples, allocated at once.
        return max_batch(budget_bytes, per_token_bytes, context_len, slot_multiple_of(options))

    def describe(self, options: dict[str, Any]) -> str:
        compiled = [what for what, key, default in (("prefill", "compile_prefill", False), ("decode", "compile", True))
                    if options.get(key, default)]
        kernel = {"blocked": ", blocked attention", BLOCKED_BF16: ", blocked attention in bf16"}.get(
            options.get("attention", "sdpa"), "")
        narrow = f", {options['kv_dtype']} K/V" if options.get("kv_dtype") else ""
        kernels = "".join(choice(option).describe(value) for option, value in _kernels(options).items())
        head = f"static, compiled {' and '.join(compiled)}" if compiled else "static"
        return head + kernel + narrow + kernels

    def simplicity_of(self, options: dict[str, Any]) -> int:
        # The bf16 kernel ranks below the exact one: among candidates tied on speed the exact one wins.
        blocked = {"blocked": 1, BLOCKED_BF16: 2}.get(options.get("attention", "sdpa"), 0)
        return (self.simplicity + bool(options.get("compile_prefill")) + blocked + bool(options.get("kv_dtype"))
                + len(_kernels(options)))

    def candidates(self, settings: dict[str, Any]) -> list[dict[str, Any]]:
        if not settings.get("include_static", True):
            return []
        multiple = int(settings.get("static_slot_multiple", DEFAULT_SLOT_MULTIPLE))
        prefills = [False, True] if settings.get("include_static_prefill", False) else [False]
        kernels = [check_kernel(k) for k in settings.get("static_attention", ["sdpa"])]
        dtypes = settings.get("static_kv_dtypes", [None])
        raced = settings.get("kernel_choices") or {}  # option -> values, each a candidate
        combos = [dict(zip(raced, values, strict=True)) for values in itertools.product(*raced.values())]
        return [cache_config(True, multiple, prefill, kernel, dtype, combo) for combo in combos
                for dtype in dtypes for prefill in prefills for kernel in kernels
                if prefill or not _names_prefill(combo)]  # the eager prefill keeps the layers' defaults

    def unavailable(self, model: nn.Module, options: dict[str, Any]) -> str | None:
        if options.get("attention", "sdpa") in ("blocked", BLOCKED_BF16):
            weight = next(iter(model.parameters()))
            if weight.device.type != "cpu":
                return f"the blocked attention kernel is measured on CPUs only; on {weight.device} the cache runs sdpa"
            if options["attention"] == BLOCKED_BF16 and decoder_reason(model) is None:  # else a copy of ``blocked``
                head_dim = getattr(model.config, "head_dim", None)
                if reason := native_attention.bf16_reason(weight.dtype, weight.device, head_dim):
                    return reason
        for option, value in _kernels(options).items():
            if reason := choice(option).reason(model, value):
                return reason
        return decoder_reason(model)


STATIC = register_kind(_StaticKind())


def _kernels(options: dict[str, Any]) -> dict[str, Any]:
    """The kernel choices a cache's options set (a value of None leaves the layers' default)."""
    return {option: options[option] for option in KERNEL_CHOICES if options.get(option) is not None}


def _names_prefill(kernels: dict[str, Any]) -> bool:
    return any("prefill" in choice(option).names_phases(value) for option, value in kernels.items()
               if value is not None)


def cache_config(compile_decode: bool = True, slot_multiple: int = DEFAULT_SLOT_MULTIPLE,
                 compile_prefill: bool = False, attention: str = "sdpa", kv_dtype: str | None = None,
                 kernels: dict[str, Any] | None = None) -> dict[str, Any]:
    # Options at their defaults are left out: the configs of old stay as they were.
    prefill = {"compile_prefill": True} if compile_prefill else {}
    kernel = {"attention": check_kernel(attention)} if attention != "sdpa" else {}
    if kv_dtype is not None:
        kv_dtype_of(kv_dtype, torch.float32)  # a misspelt dtype fails here, not when a cache is built
    narrow = {"kv_dtype": kv_dtype} if kv_dtype else {}
    # A misspelt choice or value fails here, not when a cache is built.
    chosen = {option: check_value(option, value) for option, value in (kernels or {}).items() if value is not None}
    return STATIC.config(compile=compile_decode, slot_multiple=slot_multiple, **prefill, **kernel, **narrow,
                         **chosen)
