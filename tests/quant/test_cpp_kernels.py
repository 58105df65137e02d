"""The packed GEMM ops' C++ kernels (opus.quant.cpp_kernels): exact, Python-free in compiled graphs, twins
dropped with their weights, and the Python kernels where they are not built."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opus import cpp_build
from opus.quant import cpp_kernels, packed
from opus.quant.fbgemm import FBGEMM
from opus.quant.onednn import ONEDNN
from tests.native_kit import built_or_skip

ROOT = Path(__file__).resolve().parents[2]
KERNELS = [pytest.param(kernel, id=kernel.name,
                        marks=pytest.mark.skipif(kernel.available() is not None, reason=str(kernel.available())))
           for kernel in (ONEDNN, FBGEMM)]


@pytest.fixture
def built() -> None:
    built_or_skip(cpp_kernels.load, "the C++ kernels")


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_compiled_graph_runs_the_cpp_kernel_without_python(kernel: packed.PackedKernel,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(1)
    qweight = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=generator)
    scale = torch.rand(48, generator=generator) + 0.5
    q = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=generator)
    compiled = torch.compile(lambda q: kernel.linear(q, qweight, scale), fullgraph=True,
                             options={"cpp_wrapper": True})
    with packed.use(kernel.name):
        monkeypatch.setattr(kernel, "run", lambda *args: pytest.fail("the Python kernel ran"))
        got = compiled(q)  # packs the weight on first meeting it (through the Python packing), then C++ only
        again = compiled(q)
    want = torch._int_mm(q, qweight.t()).float() * scale
    assert torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_cpp_table_drops_a_twin_with_its_weight(kernel: packed.PackedKernel) -> None:
    qweight = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    scale = torch.rand(32) + 0.5
    with packed.use(kernel.name):
        kernel.linear(torch.ones(2, 64, dtype=torch.int8), qweight, scale)
    impl = qweight._cdata
    held = torch.ops.opus_native.forget(kernel.name, impl)  # forgets it here, as the weight's end would
    assert held == 1
    kernel.linear(torch.ones(2, 64, dtype=torch.int8), qweight, scale)  # met again: packed again
    del qweight
    gc.collect()
    assert torch.ops.opus_native.forget(kernel.name, impl) == 0  # gone with the weight


def test_without_the_cpp_kernels_the_python_ones_serve() -> None:
    code = ("import torch\n"
            "from opus.quant import cpp_kernels, packed\n"
            "from opus.quant.fbgemm import FBGEMM\n"
            "qweight = torch.randint(-127, 128, (48, 64), dtype=torch.int8); scale = torch.rand(48) + 0.5\n"
            "q = torch.randint(-127, 128, (3, 64), dtype=torch.int8)\n"
            "with packed.use('fbgemm'):\n"
            "    got = FBGEMM.linear(q, qweight, scale)\n"
            "assert torch.equal(got, torch._int_mm(q, qweight.t()).float() * scale)\n"
            "print(cpp_kernels.load())\n")
    if FBGEMM.available() is not None:
        pytest.skip(str(FBGEMM.available()))
    env = {**os.environ, "OPUS_NATIVE_OPS": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "OPUS_NATIVE_OPS=0; Python kernels serve"


@pytest.mark.usefixtures("built")
def test_a_build_says_so_before_and_after_and_a_cached_one_says_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """The first build takes ~30 s: a person sees why the run is quiet, and where the build goes."""
    name = cpp_build.library_name(cpp_kernels.NAME)
    assert cpp_build.is_built(name)  # the fixture's build is cached where is_built looks
    assert cpp_kernels._build() is None and capsys.readouterr().err == ""  # cached: loaded without a word
    monkeypatch.setattr(cpp_build, "is_built", lambda _name: False)
    assert cpp_kernels._build() is None  # load_inline finds the build itself; the lines are what is checked
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "building the C++ kernels of the packed" in lines[0] and name in lines[0]
    assert lines[1].startswith("opus: built the C++ kernels of the packed int8 GEMMs in ")
