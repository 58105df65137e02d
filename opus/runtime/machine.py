"""What a speed figure was measured on: CPU model and ISA, cores and threads, torch and its kernel
library, the GPU if any, and the load average before and after.

A ratio measured on one machine says little about another (an AMD EPYC without AMX and an Intel
Xeon with it differ by several times on int8 GEMMs), and a figure taken while the machine was busy
says little at all: every speed figure Opus writes carries this record.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

# /proc/cpuinfo flags that decide which int8/bf16 kernels a CPU runs, and the names people know them by.
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX-512 VNNI", "avx512_bf16": "AVX-512 BF16",
             "avx_vnni": "AVX-VNNI", "amx_tile": "AMX", "amx_int8": "AMX-INT8", "amx_bf16": "AMX-BF16"}
CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(name: str) -> str | None:
    if not CPUINFO.is_file():
        return None
    for line in CPUINFO.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


@cache
def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


@cache
def isa() -> list[str]:
    """The ISA extensions among ``ISA_FLAGS`` this CPU reports (Linux; empty elsewhere)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return [label for flag, label in ISA_FLAGS.items() if flag in flags]


@cache
def onednn_version() -> str | None:
    """oneDNN (MKL-DNN) as built into torch, which runs its int8 and bf16 CPU GEMMs."""
    import torch

    match = re.search(r"MKL-DNN v([\d.]+)", torch.__config__.show())
    return match[1] if match else None


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


STAGE_THREADS = "OPUS_STAGE_THREADS"  # the runner's choice for "auto", in the stage worker's environment


def idle_cores(sample_s: float = 0.5) -> float:
    """How many logical cores sat idle over the next ``sample_s`` seconds (psutil's per-CPU busy shares)."""
    import psutil

    return sum(100.0 - busy for busy in psutil.cpu_percent(interval=sample_s, percpu=True)) / 100.0


def threads_for(idle: float, cores: int) -> int:
    """Threads for work that wants every core it gets, given ``idle`` cores of ``cores``: the cores at least
    80 % idle, one at the least. Eager PyTorch's threads wait for each other at every op: one on a core
    that another process holds stalls the rest (K3's fp32 prefill took x25 longer with 2 threads beside one
    busy process on 2 cores, and no longer with 1)."""
    return max(1, min(cores, int(idle + 0.2)))


def thread_count(setting: int | str | None) -> int | None:
    """``run.threads`` as a count: a number as given, None as None (the caller's default), and "auto" the
    cores idle now (``threads_for``). In a stage's worker "auto" is the count the runner chose for it."""
    if setting != "auto":
        return setting if setting is None else int(setting)
    if os.environ.get(STAGE_THREADS):
        return int(os.environ[STAGE_THREADS])
    return auto_threads()[0]


def auto_threads() -> tuple[int, float, int]:
    """``run.threads: auto`` now: (threads, idle cores, cores)."""
    idle, cores = idle_cores(), os.cpu_count() or 1
    return threads_for(idle, cores), idle, cores


def machine_record() -> dict[str, Any]:
    import psutil
    import torch

    record: dict[str, Any] = {
        "cpu": cpu_model(), "isa": isa(), "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "onednn": onednn_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_avg": load_average(),
    }
    if torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name()
        record["cuda"] = torch.version.cuda
    return record


@contextmanager
def recorded(into: dict[str, Any]) -> Iterator[None]:
    """``into["machine"]``: the record, with the 1-minute load average before and after the block."""
    record = machine_record()
    record["load_before"] = record.pop("load_avg")
    yield
    record["load_after"] = load_average()
    into["machine"] = record


def describe(record: dict[str, Any]) -> str:
    """One line for a report or a bench table."""
    isa_text = ", ".join(record.get("isa") or []) or "no AVX-512/AMX"
    load = f"load {record.get('load_before')} → {record.get('load_after')}" if "load_before" in record else ""
    gpu = f"; {record['gpu']}" if record.get("gpu") else ""
    return (f"{record.get('cpu')} ({isa_text}); {record.get('cores_logical')} cores, {record.get('threads')} threads; "
            f"torch {record.get('torch')}, oneDNN {record.get('onednn')}{gpu}" + (f"; {load}" if load else ""))
