"""Run llama.cpp's ``convert_hf_to_gguf.py`` unchanged, with one fallback (run as a script).

    python opus/bench/gguf_shim.py CONVERTER MODEL_DIR --outtype q8_0 --outfile OUT.gguf

The converter recognises a BPE tokenizer's pre-tokenizer by hashing the ids it gives for a test
string against a table of known models; a tokenizer trained by the user (K3's) is in no table, and
the converter stops. When — and only when — that happens and ``tokenizer.json`` declares a plain
byte-level pre-tokenizer with the GPT-2 split regex, this shim answers ``gpt-2`` (llama.cpp's
implementation of exactly that regex) and prints a line starting with ``OPUS-FALLBACK`` so the
caller can report it. The caller then checks that both tokenizers give the same ids.

This file imports nothing from Opus: it runs in its own interpreter, beside the converter's own
``gguf-py`` (which must win over any installed ``gguf`` package of another version).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

MARK = "OPUS-FALLBACK"


def byte_level_gpt2(model_dir: Path) -> bool:
    """True when tokenizer.json's pre-tokenizer is ByteLevel with the GPT-2 regex (alone or in a Sequence)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return len(parts) == 1 and parts[0].get("type") == "ByteLevel" and parts[0].get("use_regex", True)


def main(argv: list[str]) -> None:
    converter, model_dir = Path(argv[0]).resolve(), Path(argv[1])
    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    import conversion.base as base  # the converter's own package, next to it

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: object, tokenizer: object) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not byte_level_gpt2(model_dir):
                raise
            print(f"{MARK}: pre-tokenizer not in the converter's table; tokenizer.json is byte-level BPE "
                  "with the GPT-2 regex, written as tokenizer.ggml.pre=gpt-2", file=sys.stderr, flush=True)
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(converter), *argv[1:]]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
