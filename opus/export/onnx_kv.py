"""ONNX that generates: a decoder graph with a KV cache, which a plain onnxruntime loop runs at cached speed.

The ``onnx`` export target writes ``<export dir>/onnx/``, a self-contained directory::

    model.onnx (+ model.onnx.data)   the decoder graph, named as Hugging Face Optimum / onnxruntime-genai
    tokenizer.json ...               the model's tokenizer (when it has one)
    opus-onnx.json                   num_layers, num_kv_heads, head_dim, eos ids, dtypes, inputs and outputs

Graph inputs: ``input_ids [batch, seq]``, ``attention_mask [batch, past+seq]`` and ``position_ids
[batch, seq]`` (int64), ``past_key_values.{i}.key`` / ``.value [batch, kv_heads, past, head_dim]``;
outputs: ``logits`` (float32, ``[batch, 1, vocab]`` — the last position — or ``[batch, seq, vocab]``)
and ``present.{i}.key`` / ``.value [batch, kv_heads, past+seq, head_dim]``. A prefill passes past of
length 0.

How: ``KVDecoder`` calls the model's own forward — embedding, every decoder layer as it is (quantized,
fused), norm, lm_head — with ``PastKV``, a functional cache that concatenates the past with the new
keys and keeps the presents. Per-row positions (``position_ids``) the decoder takes from the cache
itself. Per-row padding is added while the export traces (``export_view``), and the model is put back
as it was: each attention module runs as a copy of its fx graph whose ``attend`` reads a
``[batch, 1, seq, past+seq]`` mask (slot-causal and ``attention_mask``, a token always seeing itself
so a padded row never softmaxes over nothing). A sliding-window layer, which Opus's torch decoder runs
only within its window, gets the window in its mask, as transformers applies it (tests check against its
Gemma 3). Int4 weights (``w4a16``) run as onnxruntime's MatMulNBits, and a bfloat16 graph is rewritten
to compute in float32 — onnxruntime's CPU kernels have no bf16 — its weights kept bf16 on disk
(``opus.export.onnx_ops``).
Parity, P and D: ``opus.export.onnx_check``.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from opus.atomic import write_json, write_text
from opus.export.onnx_graph import accepts_last_only, onnx_translations
from opus.export.settings import ExportSettings, one_line, opaque_call, vocab_size
from opus.export.targets import TargetOutcome
from opus.kv.cache import CacheBase
from opus.models import decoder
from opus.recipe import step_kind

ONNX_DIR = "onnx"
MODEL_FILE = "model.onnx"
META_FILE = "opus-onnx.json"
ERROR_FILE = "onnx_error.txt"  # in the export directory, when the target is not exported
FORMAT_VERSION = 1
PAST = "past_key_values.{i}.{kv}"
PRESENT = "present.{i}.{kv}"
TOTAL = "past_sequence_length + sequence_length"  # the name the exporter gives the presents' length


class PastKV(CacheBase):
    """The cache protocol over graph inputs: ``update`` returns past ++ new and records it as the present.

    ``positions`` ([B, T], per row) reaches the model's RoPE (the decoder takes per-row positions);
    ``attn_mask`` ([B, 1, T, S]: slot-causal and ``attention_mask``, a token always seeing itself so a
    padded row never softmaxes over nothing) reaches the padded attention copies.
    """

    def __init__(self, past: list[torch.Tensor], attention_mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.past, self.positions = past, positions  # past: [key 0, value 0, key 1, ...]
        self.presents: list[torch.Tensor] = list(past)
        t, past_len, device = positions.shape[1], past[0].shape[2], positions.device
        self.slots = torch.arange(past_len + t, device=device)
        self.query = torch.arange(t, device=device) + past_len
        causal = self.slots[None, :] <= self.query[:, None]  # [T, S]
        itself = (self.slots[None, :] == self.query[:, None])[None, None]
        self.attn_mask = (causal[None, None] & attention_mask.bool()[:, None, None, :]) | itself

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_all = torch.cat((self.past[2 * layer], k.to(self.past[2 * layer].dtype)), dim=2)
        v_all = torch.cat((self.past[2 * layer + 1], v.to(self.past[2 * layer + 1].dtype)), dim=2)
        self.presents[2 * layer], self.presents[2 * layer + 1] = k_all, v_all
        return k_all, v_all

    @property
    def seq_len(self) -> int:
        return int(self.past[0].shape[2])

    def reset(self) -> None:
        self.presents = list(self.past)


def _padding_mask(cache: object | None, window: int | None = None) -> torch.Tensor | None:
    """The cache's ``[B, 1, T, S]`` mask; with a sliding ``window``, only the last ``window`` slots up to each
    query (transformers' sliding-window mask: a key is visible while ``query - key < window``)."""
    mask = getattr(cache, "attn_mask", None)
    if mask is None or window is None:
        return mask
    slots, query = cache.slots, cache.query  # type: ignore[attr-defined]
    return mask & (slots[None, :] > query[:, None] - window)[None, None]


def _attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool,
                   mask: torch.Tensor | None = None, kernel: str = "sdpa",
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``decoder.attend`` with a per-row mask ``[B, 1, T, S]`` (True = visible) in place of its own; the
    graph exported is plain SDPA whatever ``kernel`` the cache asked for (its caches keep float K/V)."""
    if scales is not None:
        raise ValueError("an exported graph reads float K/V; this cache handed attention int8 bytes")
    if mask is None:
        return decoder.attend(q, k, v, causal, gqa)
    # As an additive float mask: torch.onnx writes a bool one as a Where and a NaN guard (IsNaN, Where) over
    # the whole score tensor (a fifth of K3's onnxruntime prefill). finfo.min gives the same softmax in every
    # row that sees a key, and finite values in the rows that see none (left padding, whose output no
    # visible query reads), where -inf would give NaN.
    mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    b, heads, t, d = q.shape
    group = heads // k.shape[1]
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # As decoder.attend: each KV head's query group folded into the query length (KV never expanded).
    out = F.scaled_dot_product_attention(q.reshape(b, k.shape[1], group * t, d), k, v,
                                         attn_mask=mask.repeat(1, 1, group, 1))
    return out.view(b, heads, t, d)


def _padded_copy(module: nn.Module) -> fx.GraphModule | None:
    """A copy of ``module`` (sharing its submodules) whose ``attend`` reads the padding mask; None if none."""
    from opus.fusion.tracing import copy_plain_attributes, trace

    if isinstance(module, fx.GraphModule):
        gm = fx.GraphModule(module, copy.deepcopy(module.graph), type(module).__name__)
    elif isinstance(module, decoder.Attention):
        gm = trace(module)
    else:
        return None
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    if not any(n.target is decoder.attend for n in nodes):
        return None
    guard = getattr(decoder, "window_guard", None)  # raises past the window: a graph applies the window instead
    windows = {n.args[1] for n in nodes if guard is not None and n.target is guard}
    if len(windows) > 1 or not all(isinstance(w, int) for w in windows):
        raise ValueError(f"{type(module).__name__}: sliding windows {sorted(map(str, windows))} in one attention")
    for node in nodes:
        if node.target is decoder.attend:
            node.target = _attend_padded
        elif node.target is decoder.cache_mask:
            node.target, node.args = _padding_mask, (node.args[0], next(iter(windows), None))
        elif guard is not None and node.target is guard:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    copy_plain_attributes(module, gm)
    return gm.eval()


@contextlib.contextmanager
def export_view(model: nn.Module) -> Iterator[int]:
    """While the export traces: every attention module swapped for its padded copy (the decoder itself
    takes per-row positions); the originals put back on exit. Yields the number of attention modules swapped."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []

    def swap(name: str, new: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        swapped.append((owner, child, getattr(owner, child)))
        setattr(owner, child, new)

    try:
        for name, module in list(model.named_modules()):
            new = _padded_copy(module) if name else None
            if new is not None:
                swap(name, new)
        yield len(swapped)
    finally:
        for owner, child, module in reversed(swapped):
            setattr(owner, child, module)


class KVDecoder(nn.Module):
    """``(input_ids, attention_mask, position_ids, past) -> (float32 logits, *presents)``: the model's own
    forward with a ``PastKV`` cache (run inside ``export_view``)."""

    def __init__(self, model: nn.Module, last_only: bool) -> None:
        super().__init__()
        self.model, self.last_only = model, last_only

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past_key_values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        cache = PastKV(list(past_key_values), attention_mask, position_ids)
        kw = {"last_only": True} if self.last_only else {}
        logits = self.model.forward(input_ids, cache=cache, **kw)  # forward: not a torch.compile'd __call__
        return (logits.float(), *cache.presents)


def geometry(model: nn.Module) -> dict[str, Any]:
    """Layers, heads and head_dim of an Opus decoder; a ValueError naming what is missing otherwise."""
    cfg = getattr(model, "config", None)
    trunk = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(trunk, a)]
    if cfg is None or missing or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} is not an Opus decoder (model.model.embed_tokens, rotary_emb, "
                         "layers, norm, lm_head): no KV-cache interface to export")
    return {"num_layers": len(trunk.layers), "num_heads": int(cfg.num_heads), "num_kv_heads": int(cfg.num_kv_heads),
            "head_dim": int(cfg.head_dim), "vocab_size": vocab_size(model),
            "sliding_window": getattr(cfg, "sliding_window", None)}


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [PAST.format(i=i, kv=kv) for i in range(num_layers) for kv in ("key", "value")]
    present = [PRESENT.format(i=i, kv=kv) for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_graph(model: nn.Module, path: Path, geo: dict[str, Any], last_only: bool) -> None:
    """Trace ``KVDecoder(model)`` with dynamic batch, seq and past lengths into ``path`` (+ external data)."""
    from opus.export.onnx_ops import int4_translations, optimize, rewrite
    from opus.quant.formats import export_reference

    device, dtype = next(model.parameters()).device, model_dtype(model)
    b, t, past = 2, 3, 5  # distinct and > 1: no 0/1 specialization, no accidental equalities
    ids = torch.randint(0, geo["vocab_size"], (b, t), device=device)
    kv = [torch.zeros(b, geo["num_kv_heads"], past, geo["head_dim"], device=device, dtype=dtype)
          for _ in range(2 * geo["num_layers"])]
    example = (ids, torch.ones(b, past + t, dtype=torch.long, device=device),
               torch.arange(past, past + t, device=device).expand(b, t).contiguous(), kv)
    batch, seq, past_dim = (torch.export.Dim(n) for n in ("batch_size", "sequence_length", "past_sequence_length"))
    dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim.DYNAMIC},
            "position_ids": {0: batch, 1: seq}, "past_key_values": [{0: batch, 2: past_dim}] * len(kv)}
    inputs, outputs = io_names(geo["num_layers"])
    wrapper = KVDecoder(model, last_only).eval()
    with export_view(model) as swapped, torch.no_grad(), export_reference():
        if not swapped:
            raise ValueError("no attention module calls opus.models.decoder.attend: the padding mask has no way in")
        program = torch.onnx.export(wrapper, example, dynamo=True, input_names=inputs, output_names=outputs,
                                    dynamic_shapes=dims, optimize=False, verbose=False,
                                    custom_translation_table={**onnx_translations(), **int4_translations()})
    optimize(program.model)
    program.save(str(path), external_data=True)
    rewrite(path, {"attention_mask": {1: TOTAL}}, float32=dtype == torch.bfloat16)


def _eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def save_tokenizer(tokenizer: Any, out: Path) -> str | None:
    """The tokenizer's files in ``out``; the name of its ``tokenizer.json`` (None when there is none)."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "save_pretrained"):  # transformers (fast) tokenizer: tokenizer.json + configs
        tokenizer.save_pretrained(str(out))
    elif hasattr(tokenizer, "to_str"):  # a tokenizers.Tokenizer
        write_text(out / "tokenizer.json", tokenizer.to_str())
    return "tokenizer.json" if (out / "tokenizer.json").is_file() else None


def write_meta(out: Path, model: nn.Module, tokenizer: Any, geo: dict[str, Any], last_only: bool,
               source_dtype: torch.dtype) -> dict[str, Any]:
    inputs, outputs = io_names(geo["num_layers"])
    kv_shape = ["batch_size", geo["num_kv_heads"], "past_sequence_length", geo["head_dim"]]
    meta = {
        "format": "opus-onnx-kv", "version": FORMAT_VERSION, "model": MODEL_FILE,
        "tokenizer": save_tokenizer(tokenizer, out), **geo,
        "eos_token_ids": _eos_ids(model, tokenizer), "source_dtype": str(source_dtype).removeprefix("torch."),
        "kv_dtype": "float32" if source_dtype == torch.bfloat16 else str(source_dtype).removeprefix("torch."),
        "logits": "last position [batch, 1, vocab]" if last_only else "every position [batch, seq, vocab]",
        "inputs": {"input_ids": ["batch_size", "sequence_length"], "attention_mask": ["batch_size", TOTAL],
                   "position_ids": ["batch_size", "sequence_length"], **{n: kv_shape for n in inputs[3:]}},
        "outputs": {"logits": ["batch_size", 1 if last_only else "sequence_length", geo["vocab_size"]],
                    **{n: [*kv_shape[:2], TOTAL, kv_shape[3]] for n in outputs[1:]}},
    }
    write_json(out / META_FILE, meta)
    return meta


def export_onnx(model: nn.Module, tokenizer: Any, state: dict[str, Any], out_dir: Path,
                settings: ExportSettings) -> TargetOutcome:
    """The ``onnx`` target: export, check parity in onnxruntime, measure P and D with the cache.

    Never raises for a model it cannot export: returns ``exported=False`` with a one-line reason, the
    traceback in ``<out_dir>/onnx_error.txt``, and no ``onnx/`` directory left behind.
    """
    from opus.export import onnx_check

    s, out, step = settings, Path(out_dir) / ONNX_DIR, "export"
    if not s.onnx:
        return TargetOutcome("onnx", False, reason="disabled in the export settings (onnx: false)")
    try:
        geo = geometry(model)
        last_only = s.last_only and accepts_last_only(model)
        dtype = model_dtype(model)
        shutil.rmtree(out, ignore_errors=True)
        (Path(out_dir) / ERROR_FILE).unlink(missing_ok=True)
        out.mkdir(parents=True)
        s.progress("exporting to ONNX with a KV cache (dynamo)")
        with opaque_call(s):
            export_graph(model, out / MODEL_FILE, geo, last_only)
        meta = write_meta(out, model, tokenizer, geo, last_only, dtype)
        step = "onnxruntime"
        s.progress("onnxruntime: loading and optimizing the graph")
        with opaque_call(s):
            session = onnx_check.session(out / MODEL_FILE, s)
        step = "parity"
        metrics = onnx_check.parity(model, session, meta, tokenizer, s)
        step = "measure"
        metrics.update(onnx_check.measure(session, meta, s))
        metrics["onnx_file_mb"] = sum(p.stat().st_size for p in out.glob(f"{MODEL_FILE}*")) / 2**20
        info = {"onnx_providers": session.get_providers(), **onnx_check.methods(s),
                "onnx_graph": f"KV cache in/out ({geo['num_layers']} layers), logits: {meta['logits']}",
                "onnx_recipe": [step_kind(st) for st in (state or {}).get("recipe", [])]}
        if dtype == torch.bfloat16:
            info["onnx_dtype"] = ("bfloat16 model: the graph computes in float32 from the bf16 weights (onnxruntime's "
                                  "CPU kernels have no bf16), so the parity figures also hold the bf16 rounding of "
                                  "the torch reference")
        return TargetOutcome("onnx", True, path=ONNX_DIR, metrics=metrics, info=info)
    except Exception as exc:  # noqa: BLE001 - a model ONNX cannot express is a finding, not a crash
        shutil.rmtree(out, ignore_errors=True)
        write_text(Path(out_dir) / ERROR_FILE, "".join(traceback.format_exception(exc)))
        return TargetOutcome("onnx", False, reason=f"{step}: {one_line(exc)} (traceback in {ERROR_FILE})",
                             info={"onnx_error_file": ERROR_FILE})
