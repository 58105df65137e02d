"""GGUF files for the llama.cpp contenders, made by the converter shipped in llama.cpp's source.

llama-cpp-python's wheel does not install ``convert_hf_to_gguf.py``; its sdist vendors llama.cpp,
converter (``convert_hf_to_gguf.py`` + its ``conversion`` package) and ``gguf-py`` included. The
converter is looked for, in order, at:

1. ``--converter`` / ``$OPUS_LLAMA_CPP``: the script, a llama.cpp source directory, or an sdist
   ``llama_cpp_python-*.tar.gz``;
2. the installed ``llama_cpp`` package's tree;
3. ``CACHE/llama.cpp-src/*`` (unpacked earlier) and ``llama_cpp_python-*.tar.gz`` in ``CACHE`` or
   anywhere under pip's cache directory.

An sdist is unpacked (only the converter's files) into ``CACHE/llama.cpp-src/<sdist>/``. Converted
files are kept in ``CACHE/gguf/<model fingerprint>-<converter hash>/``, so a second bench reuses them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from opus.bench.core import Unavailable

SCRIPT = "convert_hf_to_gguf.py"
SDIST_GLOB = "llama_cpp_python-*.tar.gz"
SHIM = Path(__file__).with_name("gguf_shim.py")
FALLBACK_MARK = "OPUS-FALLBACK"
FETCH_HINT = ("`pip download llama-cpp-python --no-deps --no-binary :all: -d {cache}` puts its sdist where "
              "opus bench finds it; or pass --converter PATH or --gguf FILE")


def cache_root() -> Path:
    base = os.environ.get("OPUS_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "opus"
    return Path(base)


def _script_in(directory: Path) -> Path | None:
    for candidate in (directory / SCRIPT, directory / "vendor" / "llama.cpp" / SCRIPT):
        if candidate.is_file() and (candidate.parent / "conversion").is_dir():
            return candidate
    return None


def unpack_sdist(sdist: Path, cache: Path) -> Path:
    """Extract the converter, its ``conversion`` package and ``gguf-py`` from an sdist; returns the script."""
    dest = cache / "llama.cpp-src" / sdist.name.removesuffix(".tar.gz")
    if (found := _script_in(dest)) is not None:
        return found
    partial = dest.with_name(dest.name + ".partial")
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for member in tar.getmembers():
            _, sep, rel = member.name.partition("/vendor/llama.cpp/")
            wanted = rel == SCRIPT or rel.startswith(("conversion/", "gguf-py/"))
            if sep and wanted and (member.isfile() or member.isdir()):
                member.name = rel
                members.append(member)
        if not any(m.name == SCRIPT for m in members):
            raise Unavailable(f"{sdist} holds no vendor/llama.cpp/{SCRIPT}")
        tar.extractall(partial, members=members, filter="data")
    partial.rename(dest)
    return dest / SCRIPT


def _sdists(cache: Path) -> list[Path]:
    found = sorted(cache.glob(SDIST_GLOB))
    pip_cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")
    if pip_cache.is_dir():
        found += sorted(pip_cache.rglob(SDIST_GLOB))
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find_converter(explicit: Path | None, cache: Path) -> tuple[Path, str]:
    """llama.cpp's converter script and where it came from; ``Unavailable`` when there is none."""
    given = explicit or (Path(os.environ["OPUS_LLAMA_CPP"]) if os.environ.get("OPUS_LLAMA_CPP") else None)
    if given is not None:
        if given.is_file() and given.name.endswith(".tar.gz"):
            return unpack_sdist(given, cache), f"unpacked from {given}"
        script = given if given.is_file() else _script_in(given)
        if script is None:
            raise Unavailable(f"{given}: no {SCRIPT} (with its conversion/ package) there")
        return script, str(script)
    try:
        import llama_cpp

        package = Path(llama_cpp.__file__).parent
        for directory in (package, package.parent):
            if (script := _script_in(directory)) is not None:
                return script, f"installed package ({script})"
    except ImportError:
        pass
    for unpacked in sorted((cache / "llama.cpp-src").glob("*")):
        if (script := _script_in(unpacked)) is not None:
            return script, f"unpacked sdist ({unpacked})"
    for sdist in _sdists(cache):
        return unpack_sdist(sdist, cache), f"unpacked from {sdist}"
    raise Unavailable(f"llama.cpp's {SCRIPT} not found: the llama_cpp wheel does not install it and no "
                      f"llama-cpp-python sdist is in {cache} or pip's cache; " + FETCH_HINT.format(cache=cache))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:10]


def convert(model_dir: Path, outtype: str, converter: Path, fingerprint: str, cache: Path,
            timeout_s: float = 3600) -> tuple[Path, list[str]]:
    """``model_dir`` (a Hugging Face directory) as a GGUF of ``outtype`` (f16, q8_0 ...); returns (file, notes)."""
    folder = cache / "gguf" / f"{fingerprint[:16]}-{_digest(converter)}"
    out = folder / f"model-{outtype}.gguf"
    log = out.with_suffix(".log")
    if out.is_file():
        notes = [f"GGUF {outtype}: {out} (converted earlier by {converter.name})"]
        if log.is_file() and FALLBACK_MARK in log.read_text(errors="replace"):
            notes.append(_fallback_note(log))
        return out, notes
    folder.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use the gguf-py it ships with
    started = time.perf_counter()
    with log.open("w") as fh:
        done = subprocess.run([sys.executable, str(SHIM), str(converter), str(model_dir), "--outtype", outtype,
                               "--outfile", str(partial)], stdout=fh, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s, check=False)
    text = log.read_text(errors="replace")
    if done.returncode != 0 or not partial.is_file():
        last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
        raise RuntimeError(f"{SCRIPT} --outtype {outtype} failed (exit {done.returncode}): {last.strip()[:200]} "
                           f"(log: {log})")
    partial.rename(out)
    notes = [f"GGUF {outtype} made by llama.cpp's {SCRIPT} in {time.perf_counter() - started:.1f} s: {out}"]
    if FALLBACK_MARK in text:
        notes.append(_fallback_note(log))
    return out, notes


def _fallback_note(log: Path) -> str:
    return ("the converter did not know this tokenizer's pre-tokenizer hash; tokenizer.json is byte-level BPE "
            "with the GPT-2 regex, so it was written as tokenizer.ggml.pre=gpt-2 (opus/bench/gguf_shim.py; "
            f"log {log})")
