"""``opus doctor``: what this machine can do, checked by running each kernel once."""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
from collections.abc import Callable
from typing import Any

from opus.errors import EXIT_OK


def add_parsers(sub: Any) -> None:
    sub.add_parser("doctor", help="what this machine can do: torch, CUDA, kernels, onnxruntime, disk, git")


def _try(fn: Callable[[], Any]) -> str:
    try:
        result = fn()
        return "ok" + (f" ({result})" if isinstance(result, str) else "")
    except Exception as exc:  # noqa: BLE001 - the point is to report what fails here
        return "no: " + f"{type(exc).__name__}: {exc}".splitlines()[0][:100]


def kernel_checks(device: str) -> dict[str, str]:
    import torch

    def int8_mm() -> None:
        a = torch.randint(-128, 127, (32, 64), dtype=torch.int8, device=device)
        b = torch.randint(-128, 127, (64, 32), dtype=torch.int8, device=device)
        torch._int_mm(a, b)

    def int4_mm() -> None:
        w = torch.randint(0, 16, (64, 64), dtype=torch.int32, device=device)
        x = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
        if device == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(w, 1)
            scales = torch.ones(2, 64, 2, dtype=torch.bfloat16)
            torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales)
        else:
            packed = torch._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 2)
            scales = torch.ones(2, 64, 2, dtype=torch.bfloat16, device=device)
            torch._weight_int4pack_mm(x, packed, 32, scales)

    def fp8_mm() -> None:
        if device == "cpu":
            raise RuntimeError("FP8 GEMM needs a CUDA device with FP8 support (sm_89+)")
        a = torch.randn(32, 64, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(32, 64, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return {"int8 GEMM (torch._int_mm)": _try(int8_mm), "int4 weight-only GEMM": _try(int4_mm),
            "fp8 GEMM (torch._scaled_mm)": _try(fp8_mm)}


def cmd_doctor(_: argparse.Namespace) -> int:
    import torch

    rows: list[tuple[str, str]] = [("python", sys.version.split()[0]), ("platform", platform.platform()),
                                   ("torch", torch.__version__),
                                   ("cpu threads", str(torch.get_num_threads()))]
    cuda = torch.cuda.is_available()
    rows.append(("cuda", torch.version.cuda or "not built with CUDA"))
    rows.append(("gpu", torch.cuda.get_device_name(0) if cuda else "none"))
    for name, verdict in kernel_checks("cpu").items():
        rows.append((f"cpu {name}", verdict))
    if cuda:
        for name, verdict in kernel_checks("cuda").items():
            rows.append((f"cuda {name}", verdict))
    rows.append(("onnxruntime", _try(lambda: __import__("onnxruntime").get_available_providers().__str__())))
    free = shutil.disk_usage(".").free
    rows.append(("free disk here", f"{free / 2**30:.1f} GiB"))
    rows.append(("git", _try(_git_state)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return EXIT_OK


def _git_state() -> str:
    import git

    repo = git.Repo(".", search_parent_directories=True)
    head = "detached HEAD" if repo.head.is_detached else f"branch {repo.active_branch.name}"
    dirty = "uncommitted changes" if repo.is_dirty(untracked_files=False) else "clean"
    return f"{repo.working_tree_dir}: {head}, {dirty}"


COMMANDS = {"doctor": cmd_doctor}
