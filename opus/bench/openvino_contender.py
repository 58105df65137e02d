"""OpenVINO contenders: the fp32 model on OpenVINO's CPU runtime, as is and with NNCF's int8 weights.

What a user on an Intel CPU picks instead of Opus: OpenVINO with NNCF weight compression (what
``optimum-cli export openvino --weight-format int8`` applies: int8 weights, asymmetric, per output
channel; activations stay float). The graph is Opus's own KV-cache ONNX export of the unmodified
model (``opus.export.onnx_kv``: Optimum's input and output names), read by OpenVINO and made stateful
as optimum-intel and openvino-genai run LLMs: the past keys and values live inside the infer request
(``apply_make_stateful_transformation``), so a decode step passes one token and no cache crosses the
Python boundary. Two graphs: next-token logits (generation: P, D, free-running agreement) and
all-position logits (perplexity, teacher-forced agreement).

As its users run it: ``ov`` and ``ov-int8`` leave the inference precision to OpenVINO, whose default on a
CPU with AVX-512 BF16 or AMX is bf16 (what optimum-intel's and openvino-genai's users get); ``ov-fp32``
forces f32, an extra row that shows a setting, not the default. Each row's notes say what ran.

optimum-intel itself is not used: its releases pin transformers below what Opus needs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from opus.bench.core import BenchContext, Built, Contender, Unavailable
from opus.bench.onnx_contenders import quiet_exporter

GRAPHS = ("last", "full")
MISSING = "OpenVINO or NNCF is not installed (pip install 'opus[openvino]')"


class OvSession:
    """The engine's cache for a stateful graph: how many positions the infer request's state holds."""

    def __init__(self) -> None:
        self.seq_len = 0


class StatefulGraph:
    """One compiled stateful graph and its infer request; ``run`` starts a new sequence at position 0."""

    def __init__(self, compiled: Any, geo: dict[str, Any]) -> None:
        self.compiled, self.geo = compiled, geo
        self.request = compiled.create_infer_request()
        self.logits = compiled.output("logits")

    def run(self, ids: np.ndarray, start_pos: int) -> np.ndarray:
        batch, length = ids.shape
        if start_pos == 0:
            self._empty_state(batch)
        positions = np.arange(start_pos, start_pos + length, dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones((batch, start_pos + length), np.int64),
                "position_ids": np.broadcast_to(positions, (batch, length)).copy()}
        return self.request.infer(feed)[self.logits]

    def _empty_state(self, batch: int) -> None:
        """Past of length 0 for ``batch`` rows: a reset state has no batch size to concatenate with."""
        import openvino as ov

        empty = np.zeros((batch, self.geo["num_kv_heads"], 0, self.geo["head_dim"]), np.float32)
        self.request.reset_state()
        for state in self.request.query_state():
            state.state = ov.Tensor(empty)


class OvLM(nn.Module):
    """Two stateful OpenVINO graphs behind the engine's LM interface."""

    def __init__(self, last: StatefulGraph, full: StatefulGraph) -> None:
        super().__init__()
        self.last, self.full = last, full

    def forward(self, input_ids: torch.Tensor, cache: OvSession | None = None, start_pos: int = 0,
                last_only: bool = False) -> torch.Tensor:
        ids = input_ids.cpu().numpy().astype(np.int64)
        if cache is None:  # perplexity, teacher-forced agreement: every position, a fresh sequence
            return torch.from_numpy(self.full.run(ids, 0).copy())
        if cache.seq_len != start_pos:
            raise ValueError(f"the OpenVINO state holds {cache.seq_len} positions, the engine asks for {start_pos}")
        if not last_only and start_pos:  # each graph keeps its own state: the full one runs whole sequences
            raise ValueError("the all-position graph runs whole sequences only (last_only for decode steps)")
        logits = (self.last if last_only else self.full).run(ids, start_pos)
        cache.seq_len = start_pos + ids.shape[1]
        return torch.from_numpy(logits.copy())


def _require() -> None:
    if importlib.util.find_spec("openvino") is None or importlib.util.find_spec("nncf") is None:
        raise Unavailable(MISSING)


def _export(ctx: BenchContext) -> dict[str, Any]:
    """Both KV-cache graphs of the fp32 model, exported once and shared by the OpenVINO contenders."""
    if "openvino-onnx" in ctx.shared:
        return ctx.shared["openvino-onnx"]
    from opus.export.onnx_kv import export_graph, geometry

    model = ctx.load("float32")
    try:
        geo = geometry(model)
    except ValueError as exc:
        raise Unavailable(str(exc)) from None
    started = time.perf_counter()
    paths = {}
    for graph in GRAPHS:
        paths[graph] = ctx.work_dir / "openvino" / graph / "model.onnx"
        paths[graph].parent.mkdir(parents=True, exist_ok=True)
        with quiet_exporter():
            export_graph(model, paths[graph], geo, last_only=graph == "last")
    ctx.shared["openvino-onnx"] = {"paths": paths, "geo": geo, "seconds": time.perf_counter() - started}
    return ctx.shared["openvino-onnx"]


def _compile(ctx: BenchContext, int8: bool, f32: bool) -> tuple[OvLM, list[str], float]:
    import nncf
    import openvino as ov
    from openvino._offline_transformations import apply_make_stateful_transformation

    exported = _export(ctx)
    geo, core = exported["geo"], ov.Core()
    graphs, compress_s, weights_mb = {}, 0.0, 0.0
    for graph, path in exported["paths"].items():
        model = core.read_model(str(path))
        if int8:
            started = time.perf_counter()
            nncf_log = logging.getLogger("nncf")
            level = nncf_log.level
            nncf_log.setLevel(logging.ERROR)  # its statistics table, once per graph
            try:  # and its progress bar, drawn on stdout, which holds the bench's table or JSON
                with contextlib.redirect_stdout(io.StringIO()):
                    model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
            finally:
                nncf_log.setLevel(level)
            compress_s += time.perf_counter() - started
        names = {f"past_key_values.{i}.{kv}": f"present.{i}.{kv}" for i in range(geo["num_layers"])
                 for kv in ("key", "value")}
        apply_make_stateful_transformation(model, names)
        if graph == "last":
            weights_mb = _constant_mb(model)
        config: dict[str, Any] = {"INFERENCE_NUM_THREADS": ctx.threads}
        if f32:  # the extra row: OpenVINO's default runs bf16 on CPUs with AVX-512 BF16 or AMX
            config["INFERENCE_PRECISION_HINT"] = "f32"
        graphs[graph] = StatefulGraph(core.compile_model(model, "CPU", config), geo)
    hint = graphs["last"].compiled.get_property("INFERENCE_PRECISION_HINT")
    precision = hint.to_string() if hasattr(hint, "to_string") else str(hint)
    chosen = "forced, not OpenVINO's default" if f32 else "OpenVINO's default for this CPU"
    notes = [f"OpenVINO {ov.get_version().split('-')[0]} CPU, {ctx.threads} threads, inference precision "
             f"{precision} ({chosen}); stateful "
             f"KV cache (kept inside the infer request), Opus's KV-cache ONNX export "
             f"({exported['seconds']:.1f} s for both graphs)"]
    if int8:
        notes.append(f"nncf {nncf.__version__} compress_weights INT8_ASYM (int8 weights per output channel, "
                     f"float activations; optimum-intel's --weight-format int8) in {compress_s:.1f} s")
    return OvLM(graphs["last"], graphs["full"]), notes, weights_mb


def _constant_mb(model: Any) -> float:
    """The graph's weights: every Constant's bytes (int8 after compression)."""
    return sum(op.get_byte_size() for op in model.get_ops() if op.get_type_name() == "Constant") / 2**20


def _built(ctx: BenchContext, int8: bool, f32: bool = False) -> Built:
    _require()
    if ctx.device != "cpu":
        raise Unavailable(f"the OpenVINO contenders run on its CPU plugin; the pipeline's device is {ctx.device}")
    model, notes, weights_mb = _compile(ctx, int8, f32)
    return Built(model, lambda batch, length: OvSession(), notes, {"model_mb": weights_mb})


def ov_default(ctx: BenchContext) -> Built:
    return _built(ctx, int8=False)


def ov_fp32(ctx: BenchContext) -> Built:
    return _built(ctx, int8=False, f32=True)


def ov_int8(ctx: BenchContext) -> Built:
    return _built(ctx, int8=True)


CONTENDERS = (
    Contender("ov", "OpenVINO at its default precision (stateful KV)", "openvino", ov_default),
    Contender("ov-int8", "OpenVINO, NNCF int8 weights, default precision (stateful KV)", "openvino", ov_int8),
    Contender("ov-fp32", "OpenVINO forced to f32 (stateful KV; a setting, not its default)", "openvino", ov_fp32),
)
