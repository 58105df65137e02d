"""llama.cpp contenders through llama-cpp-python (the optional extra ``opus[llama]``).

``LlamaCppLM`` drives llama.cpp's C API (``llama_decode`` on a ``llama_batch``) behind the engine's
LM interface, so Opus's engine and metrics measure it like every other contender:

- a batch of B prompts is B llama.cpp sequences (``n_seq_max = B``) decoded together — the prompt
  in one (chunked) prefill, then one ``llama_decode`` of B tokens per step — with llama.cpp's own
  KV cache; the engine picks each next token by argmax of the logits llama.cpp returns;
- without a cache (perplexity, teacher-forced agreement) every position's logits are requested.

The same token ids reach every contender: the evaluation blocks and prompts are tokenized once
with the model directory's Hugging Face tokenizer. Whether the GGUF's own tokenizer gives the same
ids for text is checked on a sample and reported in the row.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from opus.bench.core import BenchContext, Built, Contender, Unavailable

INSTALL_HINT = ("llama-cpp-python is not installed: pip install 'opus[llama]' (pip builds llama.cpp from "
                "source, about 5 minutes on 2 cores)")
SAMPLE = "def main():\n    print('héllo, wörld')  # 3.14 ✓\n\tif x >= 10:\n        return [a, b]\n"


_LOG_CALLBACK: list[Any] = []  # ctypes must keep the callback alive as long as llama.cpp may call it


def quiet_logs(api: Any) -> None:
    """llama.cpp logs every load and context at length (and warns about sizes it rounds): errors only."""
    if not _LOG_CALLBACK:
        def log(level: int, text: bytes, user_data: Any) -> None:
            if level == 4:  # GGML_LOG_LEVEL_ERROR (ggml.h; llama_cpp._logger's table is older)
                sys.stderr.write(text.decode("utf-8", errors="replace"))

        _LOG_CALLBACK.append(api.llama_log_callback(log))
    api.llama_log_set(_LOG_CALLBACK[0], ctypes.c_void_p(0))


class LlamaSession:
    """The engine's "cache" for llama.cpp: its KV memory, cleared when a request starts."""

    def __init__(self, lm: LlamaCppLM) -> None:
        self.lm = lm
        lm.clear()

    def reset(self) -> None:
        self.lm.clear()


# One prompt token through llama.cpp at its defaults, in a process of its own: a crash there (llama.cpp's
# AMX weight repacking segfaulted on an Intel Xeon with AMX, 2026-12-07) must not take the bench with it.
PROBE = """
import sys, llama_cpp
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
params = llama_cpp.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 64, 64, 1, 1
ctx = llama_cpp.llama_init_from_model(model, params)
token = (llama_cpp.llama_token * 4)(1, 2, 3, 4)
sys.exit(llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(token, 4)))
"""


@functools.cache
def defaults_run(path: Path) -> bool:
    """Whether llama.cpp runs ``path`` at its default model parameters (tried in a child process)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, timeout=300)
    return done.returncode == 0


class LlamaCppLM(nn.Module):
    def __init__(self, path: Path, n_seq_max: int, seq_len: int, n_batch: int, threads: int,
                 vocab_size: int) -> None:
        super().__init__()
        import llama_cpp

        self.api = api = llama_cpp
        quiet_logs(api)
        if n_seq_max > api.llama_max_parallel_sequences():
            raise Unavailable(f"llama.cpp takes at most {api.llama_max_parallel_sequences()} sequences at once")
        api.llama_backend_init()
        model_params = api.llama_model_default_params()
        self.repacking = defaults_run(path)
        if not self.repacking:  # what llama-server's --no-repack sets: weights in the file's own layout
            model_params.use_extra_bufts = False
        self.model_p = api.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model_p:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = api.llama_context_default_params()
        params.n_seq_max = n_seq_max
        params.n_ctx = n_seq_max * seq_len  # each sequence gets n_ctx / n_seq_max cells
        params.n_batch = n_batch
        params.n_ubatch = min(512, n_batch)
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = api.llama_init_from_model(self.model_p, params)
        if not self.ctx:
            api.llama_model_free(self.model_p)
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = api.llama_model_get_vocab(self.model_p)
        self.n_vocab = api.llama_vocab_n_tokens(self.vocab)
        if self.n_vocab < vocab_size:
            self.close()
            raise Unavailable(f"the GGUF vocabulary has {self.n_vocab} tokens, the model {vocab_size}")
        self.vocab_size, self.n_batch = vocab_size, n_batch
        self.batch = api.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)

    def _decode(self, ids: np.ndarray, start_pos: int, want: np.ndarray) -> np.ndarray:
        """Decode [B, T] ids at positions start_pos.. as sequences 0..B-1; logits of ``want`` ([B, T] bool)."""
        rows, cols = ids.shape
        flat_ids, flat_want = ids.reshape(-1), want.reshape(-1)
        seq = np.repeat(np.arange(rows, dtype=np.int32), cols)
        pos = np.tile(np.arange(start_pos, start_pos + cols, dtype=np.int32), rows)
        out = []
        b = self.batch
        for lo in range(0, flat_ids.size, self.n_batch):
            hi = min(lo + self.n_batch, flat_ids.size)
            n = hi - lo
            b.n_tokens = n
            np.ctypeslib.as_array(b.token, shape=(n,))[:] = flat_ids[lo:hi]
            np.ctypeslib.as_array(b.pos, shape=(n,))[:] = pos[lo:hi]
            np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
            np.ctypeslib.as_array(b.logits, shape=(n,))[:] = flat_want[lo:hi]
            for j in range(n):
                b.seq_id[j][0] = int(seq[lo + j])
            status = self.api.llama_decode(self.ctx, b)
            if status != 0:
                full = " (no room in the KV cache)" if status == 1 else ""
                raise RuntimeError(f"llama_decode returned {status}{full}")
            outputs = int(flat_want[lo:hi].sum())
            if outputs:
                logits = np.ctypeslib.as_array(self.api.llama_get_logits(self.ctx), shape=(outputs, self.n_vocab))
                out.append(logits[:, : self.vocab_size].copy())
        return np.concatenate(out) if out else np.empty((0, self.vocab_size), dtype=np.float32)

    def forward(self, input_ids: torch.Tensor, cache: LlamaSession | None = None, start_pos: int = 0,
                last_only: bool = False) -> torch.Tensor:
        ids = input_ids.cpu().numpy().astype(np.int32)
        rows, cols = ids.shape
        want = np.zeros((rows, cols), dtype=np.int8)
        if last_only:
            want[:, -1] = 1
        else:
            want[:] = 1
        if cache is None:  # a cache-less forward (perplexity): fresh memory before and after
            self.clear()
            logits = self._decode(ids, 0, want)
            self.clear()
        else:
            logits = self._decode(ids, start_pos, want)
        return torch.from_numpy(logits).view(rows, 1 if last_only else cols, self.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        buf = (self.api.llama_token * size)()
        n = self.api.llama_tokenize(self.vocab, data, len(data), buf, size, False, False)
        return list(buf[:n]) if n >= 0 else []

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            self.api.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            self.api.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model_p", None):
            self.api.llama_model_free(self.model_p)
            self.model_p = None


def _token_check(lm: LlamaCppLM, tokenizer: Any, ctx: BenchContext) -> str:
    """Tokenize one text both ways: the GGUF's tokenizer must give the HF tokenizer's ids."""
    from opus.runtime.data import tokenize

    text = SAMPLE
    if ctx.inputs.eval_blocks is not None:
        text += tokenizer.decode(ctx.inputs.eval_blocks[0, :200].tolist())
    hf, gguf = tokenize(tokenizer, [text])[0], lm.tokenize(text)
    if hf == gguf:
        return f"token ids: llama.cpp's tokenizer gives the HF tokenizer's ids on a {len(hf)}-token sample"
    at = next((i for i, (a, b) in enumerate(zip(hf, gguf)) if a != b), min(len(hf), len(gguf)))
    return (f"token ids DIFFER: on a sample text HF gives {len(hf)} tokens, llama.cpp {len(gguf)}; first "
            f"difference at token {at} (HF {hf[at:at + 3]}, llama.cpp {gguf[at:at + 3]}); the bench feeds both "
            "the same ids, but text tokenized by llama.cpp would differ")


def _load(ctx: BenchContext, path: Path, notes: list[str]) -> Built:
    workload, settings = ctx.workload, ctx.settings
    n_eval = ctx.eval_samples
    eval_len = 0 if ctx.inputs.eval_blocks is None else int(ctx.inputs.eval_blocks.shape[1])
    n_fid, fid_len = ctx.fidelity_prompts.shape
    n_seq = max(workload.batch_size, min(settings.eval_batch_size, max(n_eval, 1)), n_fid)
    seq_len = max(workload.input_len + workload.output_len, eval_len, fid_len + ctx.fidelity_tokens) + 1
    biggest_call = max(workload.batch_size * workload.input_len, settings.eval_batch_size * eval_len,
                       n_fid * (fid_len + ctx.fidelity_tokens))
    lm = LlamaCppLM(path, n_seq, seq_len, min(4096, biggest_call), ctx.threads, ctx.vocab_size)
    notes = [*notes, f"llama.cpp via llama-cpp-python {_version()}, {ctx.threads} threads; B prompts = B "
             "sequences in one llama_batch per step, llama.cpp's KV cache; greedy argmax by Opus's engine"]
    if not lm.repacking:
        notes.append("llama.cpp crashed at its default model parameters on this file here (a one-token run in a "
                     "child process; its weight repacking for the CPU's matrix units): loaded with "
                     "use_extra_bufts off, as llama-server's --no-repack")
    if ctx.tokenizer is not None:
        notes.append(_token_check(lm, ctx.tokenizer, ctx))
    return Built(lm, lambda batch, length: LlamaSession(lm), notes, {"model_mb": path.stat().st_size / 2**20},
                 close=lm.close)


def _version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


def _hf_dir(ctx: BenchContext) -> Path:
    path = Path(ctx.source["hf"]).expanduser()
    return path if path.is_absolute() else ctx.base_dir / path


def _require_llama() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise Unavailable(INSTALL_HINT)


def _convert_file(ctx: BenchContext, outtype: str) -> tuple[Path, list[str]]:
    """The pipeline's HF model as a GGUF made by llama.cpp's converter (cached by model and converter)."""
    from opus.bench.gguf import convert, find_converter
    from opus.pipeline.fingerprint import fingerprint_source

    _require_llama()
    if "hf" not in ctx.source:
        kind = next(iter(ctx.source))
        raise Unavailable(f"the pipeline's model is a {kind} source, not a Hugging Face directory to convert; "
                          "give --gguf FILE")
    converter, where = ctx.shared.get("converter") or find_converter(ctx.converter, ctx.cache_dir)
    ctx.shared["converter"] = (converter, where)
    path, notes = convert(_hf_dir(ctx), outtype, converter, fingerprint_source(ctx.source, ctx.base_dir),
                          ctx.cache_dir)
    return path, [f"converter: {where}", *notes]


def _converted(outtype: str) -> Any:
    def build(ctx: BenchContext) -> Built:
        path, notes = _convert_file(ctx, outtype)
        return _load(ctx, path, notes)

    return build


def quantize_file(source: Path, out: Path, ftype: str, threads: int, requantize: bool = False) -> None:
    """``source`` (an F16 GGUF; with ``requantize``, a quantized one, as ``llama-quantize
    --allow-requantize`` takes it) quantized by llama.cpp's own quantizer (``llama_model_quantize``, what
    ``llama-quantize`` runs; ``q4_k_m`` is its mix), written beside ``out`` and renamed into place."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = threads
    params.allow_requantize = requantize
    partial = out.with_name(out.name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if rc != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {source.name} -> {ftype} failed (return code {rc})")
    partial.rename(out)


def _quantized(ftype: str) -> Any:
    """A uniform ``ftype`` file (q4_0 ...) quantized by llama.cpp from the converter's F16 file."""
    def build(ctx: BenchContext) -> Built:
        f16, notes = _convert_file(ctx, "f16")
        out = f16.with_name(f"model-{ftype}.gguf")
        if out.is_file():
            notes.append(f"GGUF {ftype}: {out} (quantized earlier by llama.cpp from the F16 file)")
        else:
            quantize_file(f16, out, ftype, ctx.threads or 1)
            notes.append(f"GGUF {ftype}: quantized by llama.cpp's llama_model_quantize from {f16.name}: {out}")
        return _load(ctx, out, notes)

    return build


def user_gguf(ctx: BenchContext) -> Built:
    _require_llama()
    path = _user_file(ctx)
    return _load(ctx, path, [f"GGUF given: {path}"])


def _user_file(ctx: BenchContext) -> Path:
    path = ctx.gguf
    if path is None and "gguf" in ctx.source:
        path = Path(ctx.source["gguf"]) if Path(ctx.source["gguf"]).is_absolute() else ctx.base_dir / ctx.source["gguf"]
    if path is None or not path.is_file():
        raise Unavailable(f"no GGUF file: {path}")
    return path


def _requantized(ftype: str) -> Any:
    """The user's GGUF quantized to ``ftype`` by llama.cpp's quantizer, as its users would make a Q8_0 or
    a Q4_K_M from the file they have: the same source (the file, dequantized) Opus and every row start from."""
    def build(ctx: BenchContext) -> Built:
        from opus.pipeline.fingerprint import fingerprint_source

        _require_llama()
        source = _user_file(ctx)
        out = ctx.cache_dir / "gguf" / f"{fingerprint_source(ctx.source, ctx.base_dir)[:16]}-{ftype}.gguf"
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.is_file():
            notes = [f"GGUF {ftype}: {out} (quantized earlier by llama.cpp from {source.name})"]
        else:
            quantize_file(source, out, ftype, ctx.threads or 1, requantize=True)
            notes = [f"GGUF {ftype}: quantized by llama.cpp's llama_model_quantize from {source.name} "
                     f"(--allow-requantize): {out}"]
        return _load(ctx, out, notes)

    return build


def plan_gguf(checkpoint: Path, spec: Any, base_dir: Path, source: dict[str, Any], tokenizer: Any,
              out: Path) -> tuple[Path, list[str]]:
    """An Opus run's final model (``checkpoint``) written as a GGUF with the plan's mix
    (``opus.export.gguf_mix``) under ``out``: the file and what the notes say of it."""
    from opus.export.gguf_mix import export_gguf
    from opus.export.settings import ExportSettings
    from opus.pipeline.state import materialize

    loaded = materialize(checkpoint, spec, base_dir)
    outcome = export_gguf(loaded.model, loaded.tokenizer or tokenizer, loaded.state, out,
                          ExportSettings(source=source, base_dir=base_dir))
    del loaded
    if not outcome.exported:
        raise Unavailable(f"the run's final model has no GGUF form: {outcome.reason}")
    mix = ", ".join(f"{kind} {share:.0%}" for kind, share in outcome.info["tensor_type_mix"].items())
    notes = [f"GGUF of the final model of {checkpoint.parent.parent.name} (checkpoint {checkpoint.name}) "
             f"written by opus.export.gguf_mix: {mix} of the weights; layers: "
             + ", ".join(f"{k} ×{n}" for k, n in outcome.info["layer_formats"].items())]
    if outcome.layers_not_as_planned:
        notes.append(f"{len(outcome.layers_not_as_planned)} layers not in their planned type, e.g. "
                     + "; ".join(f"{k}: {v}" for k, v in list(outcome.layers_not_as_planned.items())[:2]))
    return out / str(outcome.path), notes


def planned_mix(ctx: BenchContext) -> Built:
    """The Opus run's final model as a GGUF with the plan's mix (``opus.export.gguf_mix``), in llama.cpp."""
    _require_llama()
    if ctx.checkpoint is None:
        raise Unavailable(ctx.no_run_reason or "no Opus run given")
    path, notes = plan_gguf(ctx.checkpoint, ctx.spec, ctx.base_dir, ctx.source, ctx.tokenizer,
                            ctx.work_dir / "llama-plan")
    return _load(ctx, path, notes)


PLANNED = Contender("llama-plan", "llama.cpp on the run's plan as GGUF (each layer in its format's type)",
                    "llama.cpp", planned_mix)


def contenders(user_file: bool) -> tuple[Contender, ...]:
    """The user's GGUF (--gguf, or a gguf model source) and the Q8_0 and Q4_K_M llama.cpp's quantizer makes
    of it; else F16 and Q8_0 made by llama.cpp's converter and Q4_0 quantized from that F16 by llama.cpp;
    then the run's final model written with the plan's mix (``llama-plan``)."""
    if user_file:
        return (Contender("llama-gguf", "llama.cpp on the given GGUF", "llama.cpp", user_gguf),
                Contender("llama-q8_0", "llama.cpp Q8_0 of the given GGUF (llama.cpp's quantizer)", "llama.cpp",
                          _requantized("q8_0")),
                Contender("llama-q4_k_m", "llama.cpp Q4_K_M of the given GGUF (llama.cpp's quantizer)", "llama.cpp",
                          _requantized("q4_k_m")),
                PLANNED)
    return (Contender("llama-f16", "llama.cpp F16 GGUF", "llama.cpp", _converted("f16")),
            Contender("llama-q8_0", "llama.cpp Q8_0 GGUF", "llama.cpp", _converted("q8_0")),
            Contender("llama-q4_0", "llama.cpp Q4_0 GGUF (llama.cpp's quantizer)", "llama.cpp", _quantized("q4_0")),
            PLANNED)

