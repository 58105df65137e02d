"""Train K3, Opus's demo Mixture-of-Experts LM, on the CPython standard library (reproducibly).

K3 is Mixtral-shaped (8 SwiGLU experts, top-2 softmax routing, GQA + RoPE, RMSNorm) and is saved as
a Hugging Face Mixtral directory that transformers and Opus both load. The run:

1. lists the stdlib ``.py`` files beside the ``os`` module (sorted; no site-packages, no tests) and
   holds out every 10th file;
2. trains a byte-level BPE tokenizer (``tokenizers``) on the train files;
3. writes small text splits for later stages: ``data/heldout`` (from held-out files) and
   ``data/calib`` (from train files);
4. trains the model with AdamW and a cosine schedule (plus the Switch load-balancing loss, taken
   from forward hooks on the routers), printing progress with an ETA;
5. reports held-out perplexity next to an add-one unigram model fitted on the train tokens, and
   saves the model, tokenizer and ``training_metrics.json``.

Usage: ``HF_HUB_OFFLINE=1 python examples/k3/train.py [--steps N] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without installing Opus

from opus.models import DecoderLM, ModelConfig  # noqa: E402

EOS = "<|endoftext|>"
SPLIT_EVERY = 10  # every 10th file (sorted order) is held out
HELDOUT_BYTES, CALIB_BYTES, MAX_FILE_BYTES = 300_000, 150_000, 40_000


def stdlib_files() -> list[tuple[str, str]]:
    """(relative name, text) of the stdlib sources, sorted for a deterministic order."""
    root = Path(os.__file__).resolve().parent
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if skip.isdisjoint(rel.parts):
            out.append((rel.as_posix(), p.read_text(encoding="utf-8", errors="replace")))
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)  # documents are separated by EOS
    return torch.tensor(ids, dtype=torch.long)


def write_split(dir_: Path, files: list[tuple[str, str]], budget: int, seed: int) -> list[tuple[str, str]]:
    """Write a deterministic sample of small files (up to `budget` bytes) as .txt; return them."""
    rng = random.Random(seed)
    pool = [f for f in files if len(f[1].encode()) <= MAX_FILE_BYTES]
    rng.shuffle(pool)
    chosen, total = [], 0
    for name, text in pool:
        size = len(text.encode())
        if total + size > budget:
            continue
        chosen.append((name, text))
        total += size
    chosen.sort()
    dir_.mkdir(parents=True, exist_ok=True)
    for old in dir_.glob("*.txt"):
        old.unlink()
    for name, text in chosen:
        (dir_ / (name.replace("/", "__") + ".txt")).write_text(text, encoding="utf-8")
    return chosen


def k3_config(vocab_size: int, eos_id: int) -> ModelConfig:
    return ModelConfig(family="mixtral", vocab_size=vocab_size, hidden_size=256, intermediate_size=192,
                       num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, num_experts=8,
                       top_k=2, moe_intermediate_size=192, norm_topk_prob=True,
                       bos_token_id=eos_id, eos_token_id=eos_id)


def init_weights(model: DecoderLM, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    scale = 0.02 / math.sqrt(2 * model.config.num_layers)  # GPT-2: shrink residual-branch outputs
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                std = scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


class RouterStats:
    """Collects router logits through forward hooks for the Switch load-balancing loss."""

    def __init__(self, model: DecoderLM) -> None:
        self.logits: list[torch.Tensor] = []
        self.top_k = model.config.top_k
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, _inputs: object, out: torch.Tensor) -> None:
        if module.training:  # evaluation passes must not accumulate graphs
            self.logits.append(out)

    def balance_loss(self) -> torch.Tensor:
        loss, n = torch.zeros(()), len(self.logits)
        for logits in self.logits:
            probs = logits.float().softmax(-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            frac = F.one_hot(chosen, probs.shape[-1]).float().sum(1).mean(0) / self.top_k
            loss = loss + probs.shape[-1] * (frac * probs.mean(0)).sum()
        self.logits.clear()
        return loss / max(1, n)


@torch.no_grad()
def perplexities(model: DecoderLM, stream: torch.Tensor, unigram_logp: torch.Tensor, seq: int,
                 batch: int) -> tuple[float, float, int]:
    """Model and unigram perplexity on the same targets: non-overlapping windows of `seq` targets."""
    n = (len(stream) - 1) // seq
    windows = torch.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)])
    nll, uni, count = 0.0, 0.0, 0
    model.eval()
    for i in range(0, n, batch):
        w = windows[i : i + batch]
        logits = model(w[:, :-1])
        nll += F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum").item()
        uni -= unigram_logp[w[:, 1:]].sum().item()
        count += w[:, 1:].numel()
    model.train()
    return math.exp(nll / count), math.exp(uni / count), count


def save_hf(model: DecoderLM, tok, out: Path, eos_id: int) -> None:
    """Save as a transformers Mixtral directory (transformers writes its own on-disk layout)."""
    from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    c = model.config
    hf_cfg = MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                           intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_layers,
                           num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                           head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                           rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                           tie_word_embeddings=c.tie_word_embeddings, num_local_experts=c.num_experts,
                           num_experts_per_tok=c.top_k, bos_token_id=eos_id, eos_token_id=eos_id,
                           pad_token_id=None, sliding_window=None)
    hf_cfg.architectures = ["MixtralForCausalLM"]
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i in range(c.num_layers):
        p = f"model.layers.{i}.mlp.experts"
        gate_up, down = [], []
        for e in range(c.num_experts):
            gate_up.append(torch.cat([sd.pop(f"{p}.{e}.gate_proj.weight"), sd.pop(f"{p}.{e}.up_proj.weight")]))
            down.append(sd.pop(f"{p}.{e}.down_proj.weight"))
        sd[f"{p}.gate_up_proj"], sd[f"{p}.down_proj"] = torch.stack(gate_up), torch.stack(down)
    hf = MixtralForCausalLM(hf_cfg)
    hf.load_state_dict(sd, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    for f in out.glob("*.safetensors"):
        f.chmod(0o644)  # transformers writes through a private (0600) temp file
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, model_max_length=2048,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)
    # transformers 5 writes its new class name; the classic one loads in 4.x and 5.x alike.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.pop("backend", None)
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")


def fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--out", type=Path, default=HERE / "model")
    ap.add_argument("--data-out", type=Path, default=None, help="default: data/ beside --out")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    args = ap.parse_args(argv)
    args.data_out = args.data_out or args.out.parent / "data"
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    files = stdlib_files()
    train_files = [f for i, f in enumerate(files) if i % SPLIT_EVERY != SPLIT_EVERY - 1]
    held_files = [f for i, f in enumerate(files) if i % SPLIT_EVERY == SPLIT_EVERY - 1]
    tok = train_tokenizer([t for _, t in train_files], args.vocab)
    eos_id = tok.token_to_id(EOS)
    heldout = write_split(args.data_out / "heldout", held_files, HELDOUT_BYTES, args.seed)
    write_split(args.data_out / "calib", train_files, CALIB_BYTES, args.seed + 1)
    train = encode_stream(tok, [t for _, t in train_files], eos_id)
    held_all = encode_stream(tok, [t for _, t in held_files], eos_id)
    held_small = encode_stream(tok, [t for _, t in heldout], eos_id)
    print(f"{len(files)} files: {len(train_files)} train ({len(train):,} tokens), {len(held_files)} held out "
          f"({len(held_all):,} tokens; {len(heldout)} files / {len(held_small):,} tokens written to data/heldout)",
          flush=True)

    counts = torch.bincount(train, minlength=args.vocab).double() + 1.0  # add-one smoothing
    unigram_logp = (counts / counts.sum()).log()

    cfg = k3_config(args.vocab, eos_id)
    model = DecoderLM(cfg)
    init_weights(model, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"K3: {n_params:,} parameters", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10 %
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    router = RouterStats(model)
    gen = torch.Generator().manual_seed(args.seed)
    curve, t0, smooth = [], time.time(), None
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([train[s : s + args.seq + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(batch[:, :-1])
        lm_loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss = lm_loss + args.aux_coef * router.balance_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = lm_loss.item() if smooth is None else 0.95 * smooth + 0.05 * lm_loss.item()
        if step % 25 == 0 or step == args.steps - 1:
            elapsed = time.time() - t0
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            tps = (step + 1) * args.batch * args.seq / elapsed
            curve.append({"step": step, "loss": round(smooth, 4)})
            print(f"step {step + 1:5d}/{args.steps}  loss {smooth:.3f}  lr {lr_at(step):.2e}  "
                  f"{tps:,.0f} tok/s  elapsed {fmt(elapsed)}  eta {fmt(eta)}", flush=True)
    train_time = time.time() - t0

    ppl, uni_ppl, n_tok = perplexities(model, held_small, unigram_logp, args.seq, args.batch)
    ppl_all, uni_all, n_all = perplexities(model, held_all, unigram_logp, args.seq, args.batch)
    save_hf(model, tok, args.out, eos_id)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    metrics = {
        "heldout_perplexity": round(ppl, 3), "unigram_perplexity": round(uni_ppl, 3), "heldout_tokens": n_tok,
        "heldout_full_perplexity": round(ppl_all, 3), "unigram_full_perplexity": round(uni_all, 3),
        "heldout_full_tokens": n_all, "train_tokens": len(train), "tokens_seen": args.steps * args.batch * args.seq,
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq, "lr": args.lr, "seed": args.seed,
        "threads": args.threads, "parameters": n_params, "safetensors_bytes": size,
        "train_seconds": round(train_time, 1), "total_seconds": round(time.time() - t_start, 1),
        "python": sys.version.split()[0], "torch": torch.__version__, "loss_curve": curve,
    }
    (args.out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"held-out perplexity {ppl:.2f} vs unigram {uni_ppl:.2f} on {n_tok:,} tokens "
          f"(full held-out split: {ppl_all:.2f} vs {uni_all:.2f} on {n_all:,}); "
          f"train {fmt(train_time)}; saved {args.out} ({size / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
