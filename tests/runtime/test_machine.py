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


@pytest.mark.parametrize(("idle", "cores", "threads"), [(1.95, 2, 2), (1.0, 2, 1), (1.7, 2, 1), (0.1, 2, 1),
                                                         (7.9, 8, 8), (5.5, 8, 5), (3.0, 2, 2)])
def test_threads_are_the_cores_at_least_80_percent_idle(idle: float, cores: int, threads: int) -> None:
    assert machine.threads_for(idle, cores) == threads


def test_auto_threads_in_a_stage_worker_are_the_runners_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert machine.thread_count(None) is None and machine.thread_count(3) == 3
    monkeypatch.setattr(machine, "idle_cores", lambda: 1.0)
    monkeypatch.delenv(machine.STAGE_THREADS, raising=False)
    assert machine.thread_count("auto") == 1  # measured here: one core idle
    monkeypatch.setenv(machine.STAGE_THREADS, "2")
    assert machine.thread_count("auto") == 2  # in a worker: what the runner chose before the stage started


def test_idle_cores_are_read_from_the_machine() -> None:
    idle = machine.idle_cores(0.1)
    assert 0.0 <= idle <= (machine.os.cpu_count() or 1) + 1e-6
