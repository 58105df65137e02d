"""Fusing one model after another in one process, with and without releasing torch.fx's dead registrations.

torch.fx registers the globals of every generated GraphModule whose code calls a wrapped op, and each
later trace patches every registration ever made (opus.fusion.tracing.release_dead_wrap_registrations).
This fuses the K3 demo model ROUNDS times with the release switched off, then ROUNDS times with it on,
in one process: seconds per fuse and the registry's size after each. A figure, not a test:

    .venv/bin/python bench/fx_registry.py              # K3, 4 fuses each way
    .venv/bin/python bench/fx_registry.py --rounds 8
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opus.fusion import FusionConfig, fuse_model, lm_probe, tracing  # noqa: E402
from opus.models.load import load_model  # noqa: E402
from opus.runtime.machine import describe, machine_record  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "examples" / "k3" / "model"


def registrations() -> int:
    from torch.fx import _symbolic_trace

    return len(_symbolic_trace._wrapped_fns_to_patch)


def fuse_rounds(rounds: int, label: str) -> list[float]:
    taken = []
    probe = lm_probe(torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0)))
    for i in range(rounds):
        model = load_model({"hf": str(MODEL)})[0]
        start = time.perf_counter()
        fuse_model(model, FusionConfig(), probe)
        taken.append(time.perf_counter() - start)
        print(f"  {label:34s} fuse {i + 1}: {taken[-1]:6.2f} s   registrations {registrations()}", flush=True)
        del model
        gc.collect()
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(describe(machine_record()))
    print(f"fuse_model on the K3 demo model, {args.rounds} times each way in one process, one thread")
    release = tracing.release_dead_wrap_registrations
    tracing.release_dead_wrap_registrations = lambda: 0  # as torch leaves it
    kept = fuse_rounds(args.rounds, "dead registrations kept")
    tracing.release_dead_wrap_registrations = release
    released = fuse_rounds(args.rounds, "dead registrations released")
    print(f"last fuse: {kept[-1]:.2f} s kept, {released[-1]:.2f} s released (x{released[-1] / kept[-1]:.2f})")


if __name__ == "__main__":
    main()
