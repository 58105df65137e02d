"""Every speed figure records the machine it was measured on (opus.runtime.machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opus.runtime import machine


def test_the_record_names_cpu_isa_threads_and_libraries() -> None:
    record = machine.machine_record()
    assert record["cpu"] and record["threads"] >= 1 and record["cores_logical"] >= 1
    assert record["torch"] and set(record["isa"]) <= set(machine.ISA_FLAGS.values())
    line = machine.describe(record)
    assert record["cpu"] in line and f"torch {record['torch']}" in line


def test_isa_is_read_from_the_cpu_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_tile amx_int8\n")
    monkeypatch.setattr(machine, "CPUINFO", cpuinfo)
    for fn in (machine.cpu_model, machine.isa):
        fn.cache_clear()
    try:
        assert machine.cpu_model() == "Some Xeon"
        assert machine.isa() == ["AVX2", "AVX-512", "AVX-512 VNNI", "AMX", "AMX-INT8"]
    finally:
        for fn in (machine.cpu_model, machine.isa):
            fn.cache_clear()


def test_recorded_adds_the_load_before_and_after() -> None:
    into: dict = {}
    with machine.recorded(into):
        assert "machine" not in into
    assert {"load_before", "load_after", "cpu", "isa"} <= set(into["machine"])
