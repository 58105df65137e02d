"""llama-cpp-python's server for ``opus bench --serve`` (``opus.runtime.server_process`` starts and stops it).

llama-cpp-python's server has no ``ignore_eos``: so that output lengths are fixed, every
end-of-generation token of the GGUF's vocabulary (``llama_vocab_is_eog``: EOS, EOT and the like) gets a
logit bias of -1e9 (``logit_bias``, applied by its sampler to every generated token).
"""

from __future__ import annotations

import sys
from pathlib import Path

from opus.runtime.server_process import Server, ServerError, free_port

EOG_BIAS = -1e9  # JSON has no -inf; far below any logit, so never sampled, greedy or not


def eog_tokens(gguf: Path) -> list[int]:
    """The GGUF's end-of-generation token ids as llama.cpp itself decides them (its vocabulary only)."""
    import llama_cpp

    from opus.bench.llamacpp import _quiet_logs

    _quiet_logs(llama_cpp)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise ServerError(f"llama.cpp could not read the vocabulary of {gguf}")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        return [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    finally:
        llama_cpp.llama_model_free(model)


def llamacpp_server(gguf: Path, threads: int, n_ctx: int, log_dir: Path) -> Server:
    """llama-cpp-python's server on ``gguf``: ``threads`` for prompt and generation alike; logits of the
    last position only (its server defaults to ``logits_all``, every prompt position's vocabulary
    logits, which only logprobs need and which would slow its prefill for nothing). It runs one request
    at a time; ``interrupt_requests`` (on by default) would end the running stream early whenever
    another request waits, so under concurrent clients it is turned off: requests queue instead."""
    port = free_port()
    eog = eog_tokens(gguf)
    flags = ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
             "--logits_all", "false", "--interrupt_requests", "false", "--verbose", "false"]
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), *flags]
    note = (f"llama_cpp.server {' '.join(flags)}; fixed output lengths: logit_bias {EOG_BIAS:g} on its {len(eog)} "
            f"end-of-generation token(s) {eog[:8]}")
    return Server("llama.cpp", command, port, "/v1/models", log_dir / "llama-server.log",
                  {"logit_bias": {str(t): EOG_BIAS for t in eog}}, [note], count_path="/extras/tokenize/count")


def llamacpp_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))
