"""onnxruntime contenders: the fp32 model exported by ``opus.export.native`` (dynamo exporter), as is and
after ``onnxruntime.quantization.quantize_dynamic`` (int8 weights, int8 activations at run time).

The exported graph maps ``input_ids -> logits`` and has no KV cache inputs, so P and D here come
from a greedy loop *without* a cache: every new token re-runs the whole sequence. That is how an
exported graph of this kind is used, and a lower bound for an onnxruntime deployment with a cache.
Two graphs are exported: next-token logits (what generation needs: P, D, free-running agreement)
and all-position logits (perplexity, teacher-forced agreement).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from opus.bench.core import BenchContext, Built, Contender, Unavailable
from opus.runtime.data import random_blocks

GRAPHS = ("last", "full")
NO_CACHE = ("P and D: greedy loop without a KV cache (the exported graph has none), each new token "
            "re-runs the whole sequence; D is one forward of the prompt")


class TokenHistory:
    """The "cache" of a cache-less graph: the token ids so far, re-run on every step."""

    def __init__(self) -> None:
        self.ids: np.ndarray | None = None

    def extend(self, new: np.ndarray) -> np.ndarray:
        self.ids = new if self.ids is None else np.concatenate((self.ids, new), axis=1)
        return self.ids

    @property
    def seq_len(self) -> int:
        return 0 if self.ids is None else int(self.ids.shape[1])

    def reset(self) -> None:
        self.ids = None


class OrtLM(nn.Module):
    """Two onnxruntime sessions behind the engine's LM interface."""

    def __init__(self, last: Any, full: Any) -> None:
        super().__init__()
        self.last, self.full = last, full

    def forward(self, input_ids: torch.Tensor, cache: TokenHistory | None = None, start_pos: int = 0,
                last_only: bool = False) -> torch.Tensor:
        ids = input_ids.cpu().numpy().astype(np.int64)
        if cache is not None:
            ids = cache.extend(ids)
        session = self.last if last_only else self.full
        logits = torch.from_numpy(session.run(["logits"], {"input_ids": ids})[0])
        return logits if last_only else logits[:, -input_ids.shape[1]:]


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """torch.onnx's notes kept off the bench's console: "torchvision is not installed" (logged once per
    export), its FutureWarnings and the note on merged axis names (once per graph)."""
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message="# The axis name", category=UserWarning)
            yield
    finally:
        exporter_log.setLevel(level)


def _files_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.parent.glob(f"{path.name}*")) / 2**20


def _export(ctx: BenchContext) -> dict[str, Any]:
    """Both graphs of the fp32 model, exported once and shared by the ONNX contenders."""
    if "onnx" in ctx.shared:
        return ctx.shared["onnx"]
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnxscript") is None:
        raise Unavailable("onnxruntime or onnxscript is not installed")
    from opus.export.onnx_graph import LogitsOnly, accepts_last_only, export_onnx
    from opus.export.settings import vocab_size

    model = ctx.load("float32")
    if not accepts_last_only(model):
        raise Unavailable(f"{type(model).__name__}.forward takes no last_only: cannot export next-token logits")
    example = random_blocks(2, 16, vocab_size(model))  # batch 2: a size-1 example would fix the batch dimension
    out = ctx.work_dir / "onnx"
    started = time.perf_counter()
    paths = {}
    with quiet_exporter():
        for graph in GRAPHS:
            (out / graph).mkdir(parents=True, exist_ok=True)
            paths[graph] = out / graph / "model.onnx"
            export_onnx(LogitsOnly(model, graph == "last").eval(), paths[graph], example)
    ctx.shared["onnx"] = {"paths": paths, "seconds": time.perf_counter() - started}
    return ctx.shared["onnx"]


def _quantized(ctx: BenchContext) -> dict[str, Any]:
    if "onnx-int8" in ctx.shared:
        return ctx.shared["onnx-int8"]
    from onnxruntime.quantization import QuantType, quantize_dynamic

    exported = _export(ctx)
    started = time.perf_counter()
    paths = {}
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer warns on the root logger about every int64 shape tensor
    try:
        for graph, src in exported["paths"].items():
            paths[graph] = src.parent.parent / f"{graph}-int8" / "model.onnx"
            paths[graph].parent.mkdir(parents=True, exist_ok=True)
            # Past 2 GB an ONNX protobuf must keep its weights in an external file.
            quantize_dynamic(str(src), str(paths[graph]), weight_type=QuantType.QInt8,
                             use_external_data_format=_files_mb(src) > 1800)
    finally:
        root.setLevel(level)
    ctx.shared["onnx-int8"] = {"paths": paths, "seconds": time.perf_counter() - started}
    return ctx.shared["onnx-int8"]


def _built(ctx: BenchContext, made: dict[str, Any], notes: list[str]) -> Built:
    from opus.export.onnx_graph import ort_session

    sessions = {g: ort_session(p, ctx.device, ctx.threads) for g, p in made["paths"].items()}
    model = OrtLM(sessions["last"], sessions["full"])
    providers = ", ".join(sessions["last"].get_providers())
    notes = [*notes, NO_CACHE, f"onnxruntime {_ort_version()} ({providers}), {ctx.threads} intra-op threads"]
    return Built(model, lambda batch, length: TokenHistory(), notes,
                 {"model_mb": _files_mb(made["paths"]["last"])})


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def onnx_fp32(ctx: BenchContext) -> Built:
    exported = _export(ctx)
    return _built(ctx, exported, [f"torch.onnx.export (dynamo) of the fp32 model in {exported['seconds']:.1f} s "
                                  "(two graphs: next-token and all-position logits)"])


def onnx_int8(ctx: BenchContext) -> Built:
    made = _quantized(ctx)
    return _built(ctx, made, [f"onnxruntime.quantization.quantize_dynamic (QInt8 weights, activations "
                              f"quantized per tensor at run time) in {made['seconds']:.1f} s"])


CONTENDERS = (
    Contender("onnx-fp32", "onnxruntime fp32", "onnxruntime", onnx_fp32),
    Contender("onnx-int8", "onnxruntime dynamic int8", "onnxruntime", onnx_int8),
)
