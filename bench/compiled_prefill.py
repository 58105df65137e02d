"""The static KV cache's compiled prefill against its eager prefill, side by side in one run.

The model is quantized as a pipeline would (uniform ``--format``, SmoothQuant where the format takes
it, opus.quant.apply) and fused (opus.fusion, every pattern; a MoE's experts grouped, in
``--prefill-experts`` mode at prefill). Then, at batch 1 and at ``--batch``, three contenders run the
same prompts in interleaved rounds (round robin, ``--repeats`` timed rounds after one warm-up that
also compiles):

- ``fp32 eager``: the float model, growing KV cache (the baseline every ratio is against);
- ``static, compiled decode``: the quantized model, decode steps compiled, prefill eager;
- ``static, compiled prefill and decode``: the same with the prompt padded to its bucket and compiled;
- ``… blocked attention``: the same with Opus's blocked causal attention at prefill
  (opus.models.attention: query blocks that skip the keys after them) in place of torch's SDPA;
- ``… and bf16 K/V``, ``… and int8 K/V``: the same with the cache keeping K/V in bfloat16, or in int8
  with a scale per token and head (opus.kv.stored; decode attention as two matmuls); lossy: each
  one's perplexity through the cache against the growing cache's is printed too;
- ``… int8 GEMMs from 2 rows``: the blocked contender with the static cache's ``w8a8_weight_only_rows: 1``
  (its compiled steps' W8A8 layers quantize their activations from two rows on instead of running decode
  sizes up to 16 rows through the weight-only kernel): what that threshold is worth on this CPU;
- ``… packed at prefill``, ``… packed at both``: that contender with the static cache's
  ``w8a8_packed_gemm`` (its compiled prefill, or its prefill and decode steps, run W8A8's int8 GEMMs
  through oneDNN's packed kernel, opus.quant.packed, instead of ``torch._int_mm``, which hands oneDNN the
  weight unpacked on every call): what packing the weights is worth on this CPU;
- ``… oneDNN prefill, FBGEMM decode``: oneDNN's packed kernel at prefill and FBGEMM's at decode, with
  ``w8a8_weight_only_rows: 0`` (int8 activations from one row, so one sequence's decode runs FBGEMM's
  int8 GEMV instead of the weight-only kernel);
- ``… int8 K/V, packed at prefill``: the blocked contender with int8 K/V (read as stored by
  opus.models.int8_kv) and oneDNN's packed kernel at prefill.

``--skip N`` leaves contender N out (0 is the baseline and stays; repeatable).

Per contender: median prefill ms (D at batch 1), median decode tokens/s, P (tokens of the batch over
the whole generate), each as a ratio to fp32 eager in the same rounds, and the greedy tokens' match
of each compiled prefill's next token with the compiled-decode contender's (eager prefill) and the
largest difference of their prefill logits (the padding must change nothing; compiled int8 code may
round differently). Compile seconds are printed apart and excluded. ``--format fp32`` leaves the weights
float. A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/compiled_prefill.py --batch 32 --input-len 512 --output-len 128
    HF_HUB_OFFLINE=1 .venv/bin/python bench/compiled_prefill.py --model /tmp/llama135m --batch 8 \\
        --input-len 128 --output-len 32
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opus.errors import OpusError  # noqa: E402
from opus.fusion import FusionConfig, fuse_model, lm_probe  # noqa: E402
from opus.fusion.moe import EXPERT_MODES, grouped_moes, set_modes  # noqa: E402
from opus.kv import static  # noqa: E402
from opus.kv.cache import cache_factory  # noqa: E402
from opus.kv.compiled_steps import compile_notes  # noqa: E402
from opus.models import load_model  # noqa: E402
from opus.pipeline.spec import TextSetSpec  # noqa: E402
from opus.quant.apply import quantize_model  # noqa: E402
from opus.quant.calibrate import collect_stats  # noqa: E402
from opus.quant.fbgemm import FBGEMM  # noqa: E402
from opus.quant.onednn import ONEDNN  # noqa: E402
from opus.runtime.data import load_blocks  # noqa: E402
from opus.runtime.engine import generate  # noqa: E402
from opus.runtime.kv_fidelity import FIDELITY_BLOCKS, FIDELITY_LEN, ppl_through_cache  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402

CONTENDERS = ("fp32 eager", "static, compiled decode", "static, compiled prefill and decode",
              "… blocked attention", "… and bf16 K/V", "… and int8 K/V", "… int8 GEMMs from 2 rows",
              "… packed at prefill", "… packed at both", "… oneDNN prefill, FBGEMM decode",
              "… int8 K/V, packed at prefill")
LOSSY = {CONTENDERS[4]: "bf16", CONTENDERS[5]: "int8"}


def optimized(base: torch.nn.Module, calib: torch.Tensor, fmt: str, prefill_experts: str = "sorted") -> torch.nn.Module:
    model = copy.deepcopy(base)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith(".gate")]
    if fmt != "fp32":
        quantize_model(model, dict.fromkeys(names, fmt), collect_stats(model, calib), group_size=64)
    fused = fuse_model(model, FusionConfig(), lm_probe(calib[:1, :32])).model
    set_modes(fused, {"prefill": prefill_experts})
    return fused


def rounds(runs: dict[str, Any], prompts: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, list[Any]]:
    """Each contender once per round, round robin; the first round (compiles, first touch) is dropped."""
    seen: dict[str, list[Any]] = {name: [] for name in runs}
    for index in range(repeats + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            result = run(prompts, new_tokens)
            if index == 0:
                print(f"  {name}: warm-up {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            else:
                seen[name].append(result)
    return seen


def prefill_gap(model: torch.nn.Module, prompts: torch.Tensor, caches: list[dict[str, Any]]) -> tuple[float, float]:
    """(share of rows whose next token agrees, largest |Δ logit| over the logits' largest |logit|) of the
    second cache's prefill against the first's."""
    first, second = (model(prompts, cache=cache_factory(model, c)(prompts.shape[0], prompts.shape[1] + 1),
                           start_pos=0, last_only=True)[:, -1] for c in caches)
    agree = float((first.argmax(-1) == second.argmax(-1)).float().mean())
    return agree, float((first - second).abs().max() / first.abs().max())


def figures(results: list[Any], batch: int, new_tokens: int) -> dict[str, float]:
    return {"prefill_ms": statistics.median(r.ttft_s for r in results) * 1e3,
            "decode_tok_s": statistics.median(batch * (new_tokens - 1) / r.decode_s for r in results),
            "p_tok_s": statistics.median(batch * new_tokens / r.total_s for r in results)}


def model_and_calibration(model: str, calib: str, prog: str) -> tuple[torch.nn.Module, Any, torch.Tensor]:
    """The model, its tokenizer and 16 calibration blocks of 256 tokens; a wrong path or an unreadable model
    or text (both given on the command line) is one line on stderr, as the CLI says bad input, and exit 2."""
    try:
        base, tokenizer = load_model({"hf": model}, ROOT)
        return base, tokenizer, load_blocks(TextSetSpec(files=[calib], samples=16, seq_len=256), tokenizer, ROOT)
    except OpusError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def positive(text: str) -> int:
    """A command-line count: a whole number above 0, else argparse's one-line error and exit 2."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number above 0, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number above 0, not {text!r}")
    return value


def k3_prefill_setup(description: str) -> tuple[Any, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The K3 prefill benches' command line (--batch, --input-len, --repeats) and what they run: the parsed
    arguments, the fp32 K3 model, 16 calibration blocks of 256 tokens and ``--batch`` held-out prompts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch", type=positive, default=1)
    parser.add_argument("--input-len", type=positive, default=512)
    parser.add_argument("--repeats", type=positive, default=15)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    base, tokenizer, calib = model_and_calibration("examples/k3/model", "examples/k3/data/calib/*.txt", parser.prog)
    prompts = load_blocks(TextSetSpec(files=["examples/k3/data/heldout/*.txt"], samples=args.batch,
                                      seq_len=args.input_len), tokenizer, ROOT)
    return args, base, calib, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/k3/model")
    parser.add_argument("--calib", default="examples/k3/data/calib/*.txt")
    parser.add_argument("--eval", default="examples/k3/data/heldout/*.txt")
    parser.add_argument("--format", default="w8a8")
    parser.add_argument("--batch", type=positive, default=32)
    parser.add_argument("--input-len", type=positive, default=512)
    parser.add_argument("--output-len", type=positive, default=128)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--skip", type=int, action="append", default=[], choices=range(1, len(CONTENDERS)))
    parser.add_argument("--prefill-experts", default="compiled", choices=EXPERT_MODES,
                        help="a MoE's experts mode at prefill (the fuse stage measures it; here it is set)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    base, tokenizer, calib = model_and_calibration(args.model, args.calib, "compiled_prefill")
    prompts = load_blocks(TextSetSpec(files=[args.eval], samples=args.batch, seq_len=args.input_len), tokenizer,
                          ROOT)
    model = optimized(base, calib, args.format, args.prefill_experts)
    why = next((r for _, moe in grouped_moes(model) if (r := moe.mode_reason(args.prefill_experts))), None)
    if why:  # before anything is timed: one line, as the CLI says a bad option
        print(f"compiled_prefill: --prefill-experts {args.prefill_experts}: {why}", file=sys.stderr)
        raise SystemExit(2)
    caches = {CONTENDERS[1]: static.cache_config(True), CONTENDERS[2]: static.cache_config(True, compile_prefill=True),
              CONTENDERS[3]: static.cache_config(True, compile_prefill=True, attention="blocked"),
              CONTENDERS[4]: static.cache_config(True, compile_prefill=True, attention="blocked", kv_dtype="bfloat16"),
              CONTENDERS[5]: static.cache_config(True, compile_prefill=True, attention="blocked", kv_dtype="int8"),
              CONTENDERS[6]: static.cache_config(True, compile_prefill=True, attention="blocked",
                                                 kernels={"w8a8_weight_only_rows": 1})}
    caches.update({CONTENDERS[6 + index]: static.cache_config(True, compile_prefill=True, attention="blocked",
                                                            kernels={"w8a8_weight_only_rows": 1,
                                                                     "w8a8_packed_gemm": where})
                   for index, where in ((1, "prefill"), (2, "both")) if ONEDNN.available() is None})
    if ONEDNN.available() is None:  # what K3's kv_config kept at batch 32 on 2026-12-06
        caches[CONTENDERS[10]] = static.cache_config(True, compile_prefill=True, attention="blocked",
                                                     kv_dtype="int8", kernels={"w8a8_packed_gemm": "prefill"})
    if ONEDNN.available() is None and FBGEMM.available() is None:  # int8 activations from one row: FBGEMM's GEMV
        caches[CONTENDERS[9]] = static.cache_config(True, compile_prefill=True, attention="blocked",
                                                    kernels={"w8a8_weight_only_rows": 0,
                                                             "w8a8_packed_gemm": {"prefill": "onednn",
                                                                                  "decode": "fbgemm"}})
    caches = {name: c for name, c in caches.items() if CONTENDERS.index(name) not in args.skip}
    runs = {CONTENDERS[0]: lambda p, n: generate(base, p, n)}
    for name, config in caches.items():
        runs[name] = lambda p, n, c=config: generate(model, p, n, cache_factory(model, c))
    table: dict[int, dict[str, dict[str, float]]] = {}
    record: dict[str, Any] = {}
    with recorded(record):
        for batch in sorted({1, args.batch}):
            seen = rounds(runs, prompts[:batch], args.output_len, args.repeats)
            table[batch] = {name: figures(results, batch, args.output_len) for name, results in seen.items()}
            for name in [n for n in CONTENDERS[2:] if n in caches]:
                agree, gap = prefill_gap(model, prompts[:batch], [static.cache_config(True), caches[name]])
                table[batch][name].update(agree=agree, gap=gap)
    held_out = prompts[:FIDELITY_BLOCKS, :FIDELITY_LEN]
    ppl = {"growing": ppl_through_cache(model, held_out, None)}
    ppl.update({short: ppl_through_cache(model, held_out, caches[name]) for name, short in LOSSY.items()
                if name in caches})
    print(f"\n{describe(record['machine'])}")
    print(f"{args.model}: {args.format} + fusion, {args.prefill_experts} experts at prefill; "
          f"input {args.input_len}, output {args.output_len}, "
          f"{args.repeats} interleaved rounds, ratios to fp32 eager in the same rounds; "
          f"threads {torch.get_num_threads()}"
          + "".join(f"; no {kernel.label} contenders: {kernel.available()}" for kernel in (ONEDNN, FBGEMM)
                    if kernel.available()))
    if compile_notes():
        print("compile fallbacks: " + "; ".join(compile_notes()))
    print(f"{'contender':<38}{'batch':>6}{'prefill ms':>11}{'×':>6}{'decode tok/s':>13}{'×':>6}{'P tok/s':>9}{'×':>6}"
          f"  prefill vs eager prefill: next token agrees, max |Δ logit|")
    for batch, rows in table.items():
        ref = rows[CONTENDERS[0]]
        for name, row in rows.items():
            same = f"{row['agree']:.3f}, {row['gap']:.1e}" if "gap" in row else ""
            print(f"{name:<38}{batch:>6}{row['prefill_ms']:>11.1f}{row['prefill_ms'] / ref['prefill_ms']:>6.2f}"
                  f"{row['decode_tok_s']:>13.1f}{row['decode_tok_s'] / ref['decode_tok_s']:>6.2f}"
                  f"{row['p_tok_s']:>9.1f}{row['p_tok_s'] / ref['p_tok_s']:>6.2f}  {same}")
    print(f"perplexity of the held-out text decoded through the cache ({FIDELITY_BLOCKS} × {FIDELITY_LEN} tokens, "
          f"second half teacher-forced): growing cache {ppl['growing']:.4f}"
          + "".join(f", {short} K/V {ppl[short]:.4f} ({ppl[short] / ppl['growing'] - 1:+.3%})"
                    for short in LOSSY.values() if short in ppl))


if __name__ == "__main__":
    main()
