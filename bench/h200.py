"""One GPU run: HF eager vs Opus eager vs Opus's static path (CUDA graphs, batched experts), bf16/fp8/w8a8/w4a16.

A ~1B-parameter Qwen3-MoE (32 experts, top-4, 16 layers, hidden 1024) with random weights, built
from a transformers ``Qwen3MoeConfig``; workload batch 32 × input 512 × output 128 (P, tokens/s, the
whole generate call timed) and one 512-token request (D, time to first token). Every contender runs
in try/except; a global time guard (``--budget``) stops starting new ones. Random weights make greedy
tokens near-ties, so besides token agreement with HF the meaningful fidelity check is teacher-forced
logits (prefill + 3 decode steps) against an fp32 reference and against HF bf16.

    python3 bench/h200.py                    # GPU (about 2-3 minutes on an H200; --budget caps it)
    python3 bench/h200.py --tiny             # CPU smoke test of the same code on a 2-layer toy

Writes ``$OUT/h200.json`` (``$OUT`` defaults to ./h200-out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing Opus
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from opus.bench.static_path.fast_decoder import FastDecoder  # noqa: E402
from opus.bench.static_path.fidelity import agreement, compare, opus_forced, runner_forced  # noqa: E402
from opus.bench.static_path.runner import StaticRunner  # noqa: E402
from opus.models import build_model, config_from_hf, load_model  # noqa: E402
from opus.models.hf import map_hf_tensors  # noqa: E402
from opus.runtime.engine import generate  # noqa: E402

T0 = time.perf_counter()
FULL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
            norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False)
# name -> (kind, options); measured in this order until the time guard trips
CONTENDERS: list[tuple[str, str, dict[str, Any]]] = [
    ("hf_eager", "hf", {"experts": "eager"}),
    ("opus_static_bf16", "static", {}),
    ("opus_static_fp8", "static", {"quant": "fp8"}),
    ("opus_eager_bf16", "eager", {}),
    ("opus_static_bf16_grouped_decode", "static", {"decode_experts": "grouped"}),
    ("opus_static_w8a8", "static", {"quant": "w8a8"}),
    ("opus_static_fp8_attn_only", "static", {"quant": "fp8", "quant_experts": False}),
    ("opus_static_w4a16", "static", {"quant": "w4a16"}),
    ("opus_static_bf16_nograph", "static", {"capture": False}),
    ("hf_default_experts", "hf", {"experts": "default"}),
]


class Skip(Exception):
    """A contender that cannot run here (said in the results, not counted as an error)."""


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- models ---------------------------------------------------------------------------------------
def build_hf(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**shape)
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)  # initialise directly in the target dtype, on the device
        with torch.device(device):
            hf = Qwen3MoeForCausalLM(cfg)
    except Exception as e:  # noqa: BLE001 - initialise in fp32 instead (more memory, same model)
        log(f"bf16 initialisation failed ({e}); initialising in fp32")
        torch.set_default_dtype(default_dtype)
        with torch.device(device):
            hf = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    hf = hf.to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # an initialiser that skipped a parameter would leave torch.empty garbage
        bad = [n for n, p in hf.named_parameters() if not torch.isfinite(p).all() or p.abs().max() > 100]
        for name in bad:
            hf.get_parameter(name).normal_(0.0, 0.02)
    if bad:
        log(f"re-initialised {len(bad)} parameters HF left uninitialised (e.g. {bad[0]})")
    hf.generation_config.eos_token_id = None  # always generate exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    return hf


def set_experts(hf: Any, impl: str) -> str:
    try:
        if hasattr(hf, "set_experts_implementation"):
            hf.set_experts_implementation(impl)
        else:
            hf.config._experts_implementation = impl
    except Exception as e:  # noqa: BLE001 - report and keep whatever HF has
        log(f"cannot set HF experts implementation {impl!r}: {e}")
    return str(getattr(hf.config, "_experts_implementation", "n/a"))


def same_model(hf: Any, model: Any, vocab: int, device: torch.device) -> float:
    """Cosine of the two models' last-position logits on a short random input (a layout-mixup guard)."""
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        a, b = hf(ids).logits[:, -1].float(), model(ids)[:, -1].float()
    return float(F.cosine_similarity(a, b, dim=-1).min())


def opus_from_hf(hf: Any, dtype: torch.dtype, device: torch.device) -> tuple[Any, str]:
    """The Opus decoder on the same weights: renamed in memory (shares storage), else via save_pretrained."""
    cfg = config_from_hf(hf.config.to_dict())
    try:
        tensors = map_hf_tensors(iter(hf.state_dict().items()), cfg)
        model = build_model(cfg, tensors, dtype, device, origin="in-memory HF model")
        cos = same_model(hf, model, cfg.vocab_size, device)
        if cos > 0.99:
            return model, f"in-memory (logits cos vs HF {cos:.4f})"
        log(f"in-memory conversion disagrees with HF (logits cos {cos:.4f}); going through save_pretrained")
    except Exception as e:  # noqa: BLE001 - fall back to the on-disk route
        log(f"in-memory conversion failed ({e}); going through save_pretrained")
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model, _ = load_model({"hf": tmp}, dtype=dtype, device=device)
    return model, f"save_pretrained + load_model (logits cos vs HF {same_model(hf, model, cfg.vocab_size, device):.4f})"


# -- fidelity -------------------------------------------------------------------------------------
def hf_forced(hf: Any, ids: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        full = torch.cat([ids, forced], 1)
        try:
            logits = hf(full, logits_to_keep=forced.shape[1] + 1).logits
        except TypeError:
            logits = hf(full).logits
    return logits[:, -(forced.shape[1] + 1) :].float()


# -- measurement ------------------------------------------------------------------------------------
def measure(run_p: Callable[[], Any], run_d: Callable[[], Any], args: argparse.Namespace, device: torch.device,
            deadline: float) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if device.type == "cuda":
        res["mem_before_gb"] = torch.cuda.memory_allocated(device) / 1e9
    res["warmup_s"], _ = timed(run_p, device)  # includes graph capture for the static path
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, out = [], None
    repeats = args.repeats if res["warmup_s"] < args.slow_s else 1  # a slow contender gets one timed run
    for i in range(repeats):
        if i and time.perf_counter() > deadline:
            res["note"] = f"time guard: {i} repeat(s)"
            break
        t, out = timed(run_p, device)
        times.append(t)
    res["times_s"] = times
    res["P_tok_s"] = args.batch * args.output_len / statistics.median(times)
    if device.type == "cuda":
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    if getattr(out, "ttft_s", None) is not None:
        res["prefill_s"], res["decode_tok_s"] = out.ttft_s, out.decode_tok_s
    timed(run_d, device)
    res["D_ms"] = 1e3 * statistics.median(timed(run_d, device)[0] for _ in range(args.d_repeats))
    res["_tokens"] = out.tokens if hasattr(out, "tokens") else out
    return res


def contender(kind: str, opts: dict[str, Any], ctx: dict[str, Any], args: argparse.Namespace,
              deadline: float) -> dict[str, Any]:
    device, ids_p, ids_d, n = ctx["device"], ctx["ids_p"], ctx["ids_d"], args.output_len
    if kind == "hf":
        hf = ctx["hf"]
        impl = set_experts(hf, ctx["hf_default_impl"] if opts["experts"] == "default" else opts["experts"])

        def hf_gen(ids: torch.Tensor, new: int) -> torch.Tensor:
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
            return out[:, ids.shape[1] :]

        res = measure(lambda: hf_gen(ids_p, n), lambda: hf_gen(ids_d, 1), args, device, deadline)
        res["experts_implementation"] = impl
        if res["_tokens"].shape[1] != n:
            res["note"] = f"HF generated {res['_tokens'].shape[1]} tokens, not {n}"
        res["fidelity_vs_ref32"] = compare(hf_forced(hf, ctx["par_ids"], ctx["forced"]), ctx["ref_logits"])
        return res
    model = ctx["opus"]
    if kind == "eager":
        res = measure(lambda: generate(model, ids_p, n), lambda: generate(model, ids_d, 1), args, device, deadline)
        logits = opus_forced(model, ctx["par_ids"], ctx["forced"])
    else:
        key = (opts.get("quant"), opts.get("quant_experts", True))
        if key not in ctx["fast"]:
            ctx["fast"].clear()
            free(device)
            build_s, ctx["fast"][key] = timed(lambda: FastDecoder(model, key[0], key[1]), device)
            log(f"  FastDecoder{key} built in {build_s:.1f}s")
        fast = ctx["fast"][key]
        if key[0] and fast.summary()["formats"]["attention"] != key[0]:
            raise Skip(f"{key[0]} cannot run here: {fast.notes[0] if fast.notes else 'unknown reason'}")
        kw = {"capture": opts.get("capture"), "decode_experts": opts.get("decode_experts", "dense")}
        runner_p = StaticRunner(fast, args.batch, args.input_len + max(n, 4), **kw)  # parity: 3 steps
        runner_d = StaticRunner(fast, 1, args.d_input_len + 1, **kw)
        res = measure(lambda: runner_p.generate(ids_p, n), lambda: runner_d.generate(ids_d, 1), args, device,
                      deadline)
        res.update(fast.summary(), captured=runner_p.captured("decode"), captured_prefill=runner_p.captured("prefill"),
                   decode_experts=runner_p.decode_experts)
        res["notes"] = res["notes"] + runner_p.notes + runner_d.notes
        par = runner_p if ctx["par_ids"].shape[0] == args.batch else StaticRunner(fast, ctx["par_ids"].shape[0],
                                                                                   args.input_len + 4, **kw)
        logits = runner_forced(par, ctx["par_ids"], ctx["forced"])
    res["fidelity_vs_ref32"] = compare(logits, ctx["ref_logits"])
    res["fidelity_vs_hf"] = compare(logits, ctx["hf_logits"])
    return res


def prepare(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    shape = {**(TINY if args.tiny else FULL)}
    if args.moe_intermediate_size:
        shape["moe_intermediate_size"] = args.moe_intermediate_size
    hf = build_hf(shape, device, dtype)
    params = sum(p.numel() for p in hf.parameters())
    log(f"HF Qwen3-MoE built: {params / 1e9:.3f} B parameters, {dtype}, {device}")
    default_impl = str(getattr(hf.config, "_experts_implementation", "eager"))
    opus, route = opus_from_hf(hf, dtype, device)
    log(f"Opus decoder loaded ({route})")
    gen = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    ids_p = torch.randint(0, vocab, (args.batch, args.input_len), generator=gen).to(device)
    ids_d = torch.randint(0, vocab, (1, args.d_input_len), generator=gen).to(device)
    par_ids = ids_p[: args.parity_rows]
    # fp32 reference on the same weights: greedy 4 steps through the engine, then HF bf16 teacher-forced
    ref32 = build_model(opus.config, {k: v for k, v in opus.state_dict().items()}, torch.float32, device, "fp32 ref")
    ref = generate(ref32, par_ids, 4, return_logits=True)
    del ref32
    free(device)
    forced = ref.tokens[:, :3]
    set_experts(hf, "eager")
    hf_logits = hf_forced(hf, par_ids, forced)
    log("fp32 reference and HF bf16 teacher-forced logits computed")
    meta = {"params": params, "hf_config": shape, "dtype": str(dtype), "opus_route": route,
            "hf_default_experts_implementation": default_impl,
            "workload": {"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
                         "d_input_len": args.d_input_len, "parity_rows": par_ids.shape[0]},
            "hf_bf16_vs_ref32": compare(hf_logits, ref.logits.float())}
    return {"device": device, "hf": hf, "hf_default_impl": default_impl, "opus": opus, "ids_p": ids_p,
            "ids_d": ids_d, "par_ids": par_ids, "forced": forced, "ref_logits": ref.logits.float(),
            "hf_logits": hf_logits, "fast": {}, "meta": meta}


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("hf_eager", {})
    head = (f"{'contender':34} {'P tok/s':>9} {'xHF':>6} {'D ms':>8} {'xHF':>6} {'peakGB':>7} {'prefill s':>9} "
            f"{'dec tok/s':>9} {'agree':>6} {'cos32':>7} {'top1':>5}  formats / status")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        if "P_tok_s" not in r:
            lines.append(f"{name:34} {r.get('status', '?')}")
            continue
        nan = float("nan")
        xp = r["P_tok_s"] / base["P_tok_s"] if base.get("P_tok_s") else nan
        xd = base["D_ms"] / r["D_ms"] if base.get("D_ms") else nan
        fid = r.get("fidelity_vs_ref32", {})
        agree = r.get("agreement_vs_hf_eager", {}).get("token_match", nan)
        lines.append(f"{name:34} {r['P_tok_s']:9.0f} {xp:6.2f} {r['D_ms']:8.1f} {xd:6.2f} "
                     f"{r.get('peak_mem_gb', nan):7.2f} {r.get('prefill_s', nan):9.3f} "
                     f"{r.get('decode_tok_s', nan):9.0f} {agree:6.2f} {fid.get('cos_mean', nan):7.4f} "
                     f"{fid.get('top1', nan):5.2f}  {r.get('formats', r.get('experts_implementation', ''))}")
    return "\n".join(lines)


def save(report: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 2 layers, hidden 64, 4 experts")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--d-input-len", type=int)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--d-repeats", type=int, default=3)
    ap.add_argument("--parity-rows", type=int, default=32)
    ap.add_argument("--moe-intermediate-size", type=int)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds after which no new contender starts")
    ap.add_argument("--slow-s", type=float, default=20.0, help="a warm-up slower than this gets one timed run")
    ap.add_argument("--only", help="comma-separated contender names (default: all)")
    args = ap.parse_args()
    small = (4, 32, 8, 32) if args.tiny else (32, 512, 128, 512)
    for name, value in zip(("batch", "input_len", "output_len", "d_input_len"), small):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.parity_rows = min(args.parity_rows, args.batch)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        log("no CUDA device: running the --tiny configuration instead")
        args.tiny = True
    out_dir = Path(os.environ.get("OUT") or "h200-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("h200-tiny.json" if args.tiny else "h200.json")
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: OpenMP spin-waits only cost time on a shared CPU
    deadline = T0 + args.budget
    import transformers

    transformers.logging.set_verbosity_error()  # per-call generation warnings would flood the log
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None}
    log(f"environment: {env}")
    report: dict[str, Any] = {"env": env, "results": {}}
    results: dict[str, dict[str, Any]] = report["results"]
    try:
        ctx = prepare(args, device, torch.bfloat16)
        report["meta"] = ctx["meta"]
        log(f"HF bf16 vs fp32 reference: {ctx['meta']['hf_bf16_vs_ref32']}")
    except Exception as e:  # noqa: BLE001 - nothing to measure without the models; still write the JSON
        traceback.print_exc()
        report["error"] = f"setup failed: {e!r}"
        report["traceback"] = traceback.format_exc()
        ctx = None
    wanted = set(args.only.split(",")) if args.only else None
    for name, kind, opts in CONTENDERS if ctx else []:
        if wanted and name not in wanted:
            continue
        if time.perf_counter() > deadline:
            results[name] = {"status": f"skipped: time guard ({args.budget:.0f}s) reached"}
            log(f"{name}: skipped (time guard)")
            continue
        if name == "hf_default_experts" and ctx["hf_default_impl"] in ("eager", "n/a", "None"):
            results[name] = {"status": f"skipped: HF default experts implementation is {ctx['hf_default_impl']}"}
            continue
        log(f"{name}: start")
        try:
            res = contender(kind, opts, ctx, args, deadline)
            tokens = res.pop("_tokens")
            if name == "hf_eager":
                ctx["hf_tokens"] = tokens
            elif "hf_tokens" in ctx:
                res["agreement_vs_hf_eager"] = agreement(tokens, ctx["hf_tokens"])
            res["status"] = "ok"
            graphs = "" if "captured" not in res else (
                f", CUDA graphs: decode {res['captured']}, prefill {res['captured_prefill']}" if device.type == "cuda"
                else ", CUDA graphs: skipped (capture is CUDA-only; same step functions run eagerly)")
            log(f"{name}: P {res['P_tok_s']:.0f} tok/s, D {res['D_ms']:.1f} ms{graphs}, "
                f"fidelity {res.get('fidelity_vs_ref32')}, notes {res.get('notes', [])[:3]}")
        except Skip as e:
            res = {"status": f"skipped: {e}"}
            log(f"{name}: {res['status']}")
        except Exception as e:  # noqa: BLE001 - one contender failing must not stop the others
            traceback.print_exc(limit=-4)
            res = {"status": f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                   "traceback": traceback.format_exc()}
            log(f"{name}: {res['status']}")
        results[name] = res
        free(device)
        save(report, path)  # after every contender: a run killed later still leaves its results
    report["elapsed_s"] = time.perf_counter() - T0
    print("\n" + table(results), flush=True)
    save(report, path)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
