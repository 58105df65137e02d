"""llama.cpp's servers for ``opus bench --serve`` (``opus.runtime.server_process`` starts and stops them).

``llama-server`` (llama.cpp's own, ``--parallel N`` slots with continuous batching: how llama.cpp's users
serve) when a binary is found (``--llama-server PATH``, ``llama-server`` on the PATH, or the one ``make
llama-server`` builds from llama-cpp-python's vendored llama.cpp); else llama-cpp-python's server, which
runs one request at a time, and the report says so. llama-server takes ``ignore_eos`` for fixed output
lengths; llama-cpp-python's has none, so every end-of-generation token of the GGUF's vocabulary
(``llama_vocab_is_eog``: EOS, EOT and the like) gets a logit bias of -1e9 (``logit_bias``, applied by its
sampler to every generated token).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from opus.runtime.server_process import Server, ServerError, free_port

EOG_BIAS = -1e9  # JSON has no -inf; far below any logit, so never sampled, greedy or not


def eog_tokens(gguf: Path) -> list[int]:
    """The GGUF's end-of-generation token ids as llama.cpp itself decides them (its vocabulary only)."""
    import llama_cpp

    from opus.bench.llamacpp import quiet_logs

    quiet_logs(llama_cpp)
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
    from opus.bench.llamacpp import defaults_run

    port = free_port()
    eog = eog_tokens(gguf)
    flags = ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
             "--logits_all", "false", "--interrupt_requests", "false", "--verbose", "false"]
    notes = [f"llama_cpp.server {' '.join(flags)}; fixed output lengths: logit_bias {EOG_BIAS:g} on its {len(eog)} "
             f"end-of-generation token(s) {eog[:8]}"]
    launch = ["-m", "llama_cpp.server"]
    if not defaults_run(gguf):  # its server has no --no-repack: the same setting, made in its own process
        launch = ["-c", NO_REPACK_SERVER]
        notes.append("llama.cpp crashed at its default model parameters on this file here (its weight repacking "
                     "for the CPU's matrix units, tried in a child process): served with use_extra_bufts off, as "
                     "llama-server's --no-repack")
    command = [sys.executable, *launch, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
    return Server("llama.cpp", command, port, "/v1/models", log_dir / "llama-server.log",
                  {"logit_bias": {str(t): EOG_BIAS for t in eog}}, notes, count_path="/extras/tokenize/count")


# llama-cpp-python's server with every model loaded as llama-server's --no-repack loads it.
NO_REPACK_SERVER = """
import runpy
import llama_cpp.llama_cpp as api
default = api.llama_model_default_params
def no_repack():
    params = default()
    params.use_extra_bufts = False
    return params
api.llama_model_default_params = no_repack
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


LLAMA_SERVER = "llama-server"


def built_llama_server() -> Path:
    """Where ``make llama-server`` puts the binary it builds (under Opus's cache, ``opus.bench.gguf``)."""
    from opus.bench.gguf import cache_root

    return cache_root() / "llama-server" / "build" / "bin" / LLAMA_SERVER


def find_llama_server(given: Path | None) -> Path | None:
    """``given`` (which must exist), else ``llama-server`` on the PATH, else the one ``make llama-server`` built."""
    import shutil

    if given is not None:
        if not given.is_file():
            raise ServerError(f"--llama-server {given}: no such file")
        return given
    found = shutil.which(LLAMA_SERVER)
    if found:
        return Path(found)
    built = built_llama_server()
    return built if built.is_file() else None


def llama_server(binary: Path, gguf: Path, threads: int, n_ctx: int, slots: int, log_dir: Path) -> Server:
    """llama.cpp's ``llama-server`` as its users run it for several clients: ``--parallel slots`` (each slot
    ``n_ctx`` tokens of one shared context, continuous batching on, llama.cpp's default), ``threads`` for
    prompt and generation; ``ignore_eos`` in each request for fixed output lengths."""
    port = free_port()
    flags = ["--threads", str(threads), "--threads-batch", str(threads), "--ctx-size", str(n_ctx * slots),
             "--parallel", str(slots), "--cont-batching"]
    command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
    note = f"llama-server {' '.join(flags)}; fixed output lengths: ignore_eos"
    return Server("llama.cpp", command, port, "/health", log_dir / "llama-server.log", {"ignore_eos": True}, [note],
                  count_path="/tokenize", count_style="tokens")


def without_repacking(server: Server) -> Server | None:
    """llama-server again with ``--no-repack`` when it crashed (SIGSEGV) before it was ready at its defaults:
    its weight repacking for the CPU's matrix units (AMX here) can crash a build that runs otherwise; the
    note says so, as a setting its users would have to make too. None for any other failure."""
    crashed = server.process is not None and server.process.returncode == -11
    if not crashed or "--no-repack" in server.command or Path(server.command[0]).name != LLAMA_SERVER:
        return None
    port = free_port()
    command = [*server.command, "--no-repack"]
    command[command.index("--port") + 1] = str(port)
    again = dataclasses.replace(server, command=command, port=port, notes=list(server.notes), process=None)
    again.notes.append("llama-server crashed at its defaults (SIGSEGV before it was ready, in its weight repacking "
                       "for this CPU's matrix units): run with --no-repack, weights in the GGUF's own layout")
    return again


def llama_server_version(binary: Path) -> str:
    import subprocess

    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return f"? ({exc})"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "version" in line.lower()]
    return lines[0].strip() if lines else "?"


def llamacpp_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))
