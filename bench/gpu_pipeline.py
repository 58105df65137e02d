"""The CUDA path end to end through a pipeline: `opus run` on the K3-shaped 0.9B MoE, then `opus bench`.

bench/h200.py times Opus's GPU pieces one by one; this runs them the way a user does, through the
stage chain (baseline, profile, plan over fp8 and w8a8, quantize, fuse, kv_config with the CUDA-graph
decode, eval side by side with the bf16 baseline), and then `opus bench` on the run, where HF eager,
Opus bf16 eager and the run's model are timed in the same interleaved rounds. The model is the
~0.9B-parameter Qwen3-MoE of bench/h200.py (32 experts, top-4, 16 layers, hidden 1024) with random
weights, written by transformers' `save_pretrained` with the K3 demo's tokenizer beside it: speed
figures are real, accuracy figures only say that quantization kept a random model's outputs.

    python3 bench/gpu_pipeline.py                  # on a GPU machine (workload 32 × 512 → 128)
    python3 bench/gpu_pipeline.py --tiny           # CPU dry run of the same code on a 2-layer toy

Writes the logs and the run's summary, report and bench table under ``--out`` ($OUT, else ./gpu-out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from h200 import FULL, TINY, build_hf  # noqa: E402  (the same model shapes and initialisation)

K3 = ROOT / "examples" / "k3"


def write_model(path: Path, tiny: bool, device: str, dtype: torch.dtype) -> None:
    """The random-weight MoE as a transformers directory, with the K3 tokenizer (ids < its 4,096)."""
    shape = dict(TINY, vocab_size=4096) if tiny else FULL
    hf = build_hf(shape, torch.device(device), dtype)
    hf.generation_config.eos_token_id = 0
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(K3 / "model" / name, path / name)
    del hf


def pipeline(model: Path, tiny: bool, device: str) -> dict:
    """The demo's stage chain, on the GPU's formats and the issue's workload (tiny: a toy one)."""
    data = {
        "calibration": {"files": [str(K3 / "data/calib/*.txt")], "samples": 4 if tiny else 16,
                        "seq_len": 64 if tiny else 256, "seed": 0},
        "evaluation": {"files": [str(K3 / "data/heldout/*.txt")], "samples": 4 if tiny else 32,
                       "seq_len": 64 if tiny else 256, "seed": 0},
    }
    workload = ({"batch_size": 2, "input_len": 32, "output_len": 8, "warmup": 0, "repeats": 1} if tiny else
                {"batch_size": 32, "input_len": 512, "output_len": 128, "warmup": 1, "repeats": 3})
    cuda = device.startswith("cuda")
    formats = ["fp8", "w8a8"] if cuda else ["w8a8"]
    return {
        "name": "gpu-moe",
        "description": "K3-shaped 0.9B MoE (random weights) through the CUDA path",
        "model": {"hf": str(model), "dtype": "bfloat16" if cuda else "float32",
                  "device": device},
        "data": data,
        "workload": workload,
        "run": {"stall_timeout_s": 900, "max_retries": 1},
        "stages": [
            {"id": "baseline", "uses": "baseline"},
            {"id": "profile", "uses": "profile", "needs": ["baseline"], "with": {"batch_size": 8, "repeats": 3}},
            {"id": "plan", "uses": "plan", "needs": ["profile"],
             "with": {"formats": formats, "budget": {"max_ppl_increase": 0.02}}},
            {"id": "quantize", "uses": "quantize", "needs": ["plan"],
             "gate": {"perplexity": {"max_increase": 0.02}}, "on_fail": "retry"},
            # The stage checks its own exact match (0.95 by default); a random model's near-ties need less.
            {"id": "fuse", "uses": "fuse", "needs": ["quantize"], "with": {"check": {"min_exact_match": 0.9}},
             "on_fail": "skip"},
            # On CUDA the decode step is captured in a CUDA graph (kind cuda_graph), which removes the
            # dispatch cost that inductor's compiled step removes on CPU, without its minutes of compiling.
            {"id": "kv_config", "uses": "kv_config", "needs": ["fuse"],
             "with": {"include_static": not cuda}},
            # No agreement gate: a random model's greedy tokens are near-ties (bench/h200.py).
            {"id": "eval", "uses": "eval", "needs": ["baseline", "kv_config"],
             "gate": {"perplexity": {"max_increase": 0.02}, "throughput": {"min_ratio": 1.1}}, "on_fail": "abort"},
        ],
    }


def opus(args: list[str], log: Path, timeout_s: float) -> int:
    """One `opus` command as a user types it, its output to the terminal and to ``log``. Past
    ``timeout_s`` it gets SIGTERM, which opus handles as Ctrl-C (the run stops resumable, and says so)."""
    cmd = [sys.executable, "-c", "import sys; from opus.cli.main import main; sys.exit(main())", *args]
    print("$ opus " + " ".join(args), flush=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        fired = threading.Event()

        def stop() -> None:
            fired.set()
            proc.terminate()

        guard = threading.Timer(timeout_s, stop)
        guard.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
        rc = proc.wait()
        guard.cancel()
    sys.stdout.flush()
    if fired.is_set():
        print(f"time guard: stopped after {timeout_s:.0f} s (exit {rc})", flush=True)
        return 124
    return rc


def keep(out: Path, runs: Path) -> None:
    """The run's small files (summary, report, events, stage logs and metrics) in one archive, no tensors."""
    with tarfile.open(out / "run.tar.gz", "w:gz") as tar:
        for path in sorted(runs.rglob("*")):
            if path.is_file() and path.suffix in {".json", ".jsonl", ".html", ".yaml", ".md", ".txt", ".png", ".log"} \
                    and path.stat().st_size < 4 << 20:
                tar.add(path, arcname=str(path.relative_to(runs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: 2 layers, hidden 64, 4 experts")
    ap.add_argument("--work", help="an absent or empty folder for the model, pipeline and runs (large files); "
                    "default: a new folder under the system's temporary folder")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), help="logs and small results")
    ap.add_argument("--run-timeout", type=float, default=420.0, help="seconds the pipeline may take")
    ap.add_argument("--bench-timeout", type=float, default=150.0, help="seconds opus bench may take (0: no bench)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to opus run")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="opus-gpu-"))
    if work.exists() and any(work.iterdir()):
        print(f"error: --work {work} is not empty (the model and runs are written there; name a new folder)",
              file=sys.stderr)
        sys.exit(2)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_model(work / "model", args.tiny, device, torch.bfloat16 if device == "cuda" else torch.float32)
    print(f"model written in {time.perf_counter() - t0:.1f} s", flush=True)
    spec = work / "gpu.yaml"
    spec.write_text(yaml.safe_dump(pipeline(work / "model", args.tiny, device), sort_keys=False))
    runs = work / "runs"
    sets = [arg for kv in args.set for arg in ("--set", kv)]
    rc = opus(["run", str(spec), "--runs-dir", str(runs), *sets], out / "run.log", args.run_timeout)
    bench_rc = None
    # The bench reads the finished run; after a failed one it would time a stale or no model.
    if rc == 0 and args.bench_timeout > 0:
        bench_rc = opus(["bench", str(spec), "--runs-dir", str(runs), "--only", "hf,bf16,opus",
                         "--out", str(out / "bench")], out / "bench.log", args.bench_timeout)
    keep(out, runs)
    (out / "exit.json").write_text(json.dumps({"run_rc": rc, "bench_rc": bench_rc,
                                               "wall_s": round(time.perf_counter() - t0, 1)}))
    print(f"run rc {rc}, bench rc {bench_rc}, {time.perf_counter() - t0:.0f} s in all", flush=True)
    sys.exit(rc or bench_rc or 0)


if __name__ == "__main__":
    main()
