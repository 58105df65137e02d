"""onnxruntime prefill of several ONNX exports side by side: interleaved rounds in one process.

Each argument is an export's ``onnx/`` directory, or the export directory (or a run's export stage
artifacts) holding one; the first is the baseline of the ratios. Every session gets the same prompt
(random ids, an empty cache) at each batch size, in rounds over the contenders. A figure, not a test:

    .venv/bin/python bench/onnx_prefill.py OLD/onnx NEW/onnx                  # batch 1 and 32 x 512 tokens
    .venv/bin/python bench/onnx_prefill.py OLD NEW --batch 1 --tokens 128 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opus.export.onnx_kv import META_FILE as META  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402
from opus.runtime.timed_choice import Option, interleave  # noqa: E402


def onnx_dir(path: Path) -> Path:
    for candidate in (path, path / "onnx", path / "export" / "onnx"):
        if (candidate / META).is_file():
            return candidate
    print(f"error: {path}: no {META} here or in onnx/ below it (an Opus ONNX export)", file=sys.stderr)
    raise SystemExit(2)


def prompt(meta: dict, names: list[str], batch: int, tokens: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(0).integers(0, meta["vocab_size"], (batch, tokens))
    feed = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((batch, tokens), np.int64),
            "position_ids": np.broadcast_to(np.arange(tokens), (batch, tokens)).astype(np.int64)}
    empty = np.zeros((batch, meta["num_kv_heads"], 0, meta["head_dim"]), np.dtype(meta["kv_dtype"]))
    feed.update({name: empty for name in names if name.startswith("past_key_values.")})
    return feed


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="+", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    dirs = [onnx_dir(p) for p in args.exports]
    labels = [str(p) for p in args.exports]
    metas = [json.loads((d / META).read_text()) for d in dirs]
    sessions = [ort.InferenceSession(str(d / m["model"]), options, providers=["CPUExecutionProvider"])
                for d, m in zip(dirs, metas)]
    record: dict = {}
    results: dict[int, dict[str, list[float]]] = {}
    with recorded(record):
        for batch in args.batch:
            feeds = [prompt(m, [i.name for i in s.get_inputs()], batch, args.tokens) for m, s in zip(metas, sessions)]
            contenders = [Option(label, lambda s=s, f=f: s.run(None, f))
                          for label, s, f in zip(labels, sessions, feeds)]
            results[batch] = interleave(contenders, args.rounds, warmup=1)
    print(describe(record["machine"]))
    print(f"onnxruntime {ort.__version__} prefill of {args.tokens} tokens, {args.threads} threads; "
          f"median of {args.rounds} interleaved rounds; ratios against the first")
    for batch, times in results.items():
        base = statistics.median(times[labels[0]])
        for label in labels:
            median = statistics.median(times[label])
            print(f"  batch {batch:3d}  {label:40s} {median * 1e3:9.1f} ms  x{median / base:.3f}")


if __name__ == "__main__":
    main()
