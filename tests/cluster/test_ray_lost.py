"""Reaching a Ray cluster, and losing it mid-way (opus.cluster.ray_pool); each test owns its instance."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from opus.cluster import ray_pool as pool_module
from opus.cluster.ray_pool import ClusterError, RayPool, ray_pool
from opus.cluster.settings import RaySettings

pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'opus[ray]'); make test installs it")
TASKS = "tests.cluster.faulty"


def test_an_unreachable_cluster_is_one_clear_error() -> None:
    with pytest.raises(ClusterError, match=r"run.executor.ray.address 'ray://127.0.0.1:9': cannot start or reach"):
        RayPool(RaySettings(address="ray://127.0.0.1:9"))


def test_a_cluster_lost_mid_way_ends_the_work_with_a_clear_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The control store is killed while a task runs: the wait notices within its health check."""
    monkeypatch.setattr(pool_module, "HEALTH_EVERY_S", 1.0)
    monkeypatch.setattr(pool_module, "SHUTDOWN_TIMEOUT_S", 5.0)

    def kill_when_started() -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / "slow.started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        subprocess.run(["pkill", "-9", "-f", "ray/core/src/ray/gcs/gc[s]_server"], check=False)

    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"was lost mid-way .*opus resume"):
        with ray_pool(RaySettings(local_cpus=1)) as p:
            threading.Thread(target=kill_when_started, daemon=True).start()
            list(p.run(f"{TASKS}:slow", p.share(str(tmp_path), b""), ["s"]))
    assert time.monotonic() - started < 50  # not the task's minute, nor Ray's own reconnect timeout


def test_a_task_wider_than_every_node_is_refused_at_once() -> None:
    """Ray would keep such a task pending forever; a bad setting is input, not a crash to retry."""
    from opus.errors import OpusError

    with pytest.raises(OpusError, match=r"num_cpus_per_task is 3, but the largest node of the cluster has 2 CPUs"):
        RayPool(RaySettings(local_cpus=2, num_cpus_per_task=3))
    import ray

    assert not ray.is_initialized()  # the instance it started for the check is stopped
    nodes = [{"Alive": True, "Resources": {"CPU": 8.0}}, {"Alive": False, "Resources": {"CPU": 16.0, "GPU": 1.0}}]
    assert "has 0 GPUs" in pool_module._too_wide(nodes, RaySettings(num_gpus_per_task=1))
    assert pool_module._too_wide(nodes, RaySettings(num_cpus_per_task=8)) is None
