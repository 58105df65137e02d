"""Reaching a Ray cluster, and losing it mid-way (opus.cluster.ray_pool); each test owns its instance."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opus.cluster import ray_pool as pool_module
from opus.cluster.ray_pool import ClusterError, RayPool
from opus.cluster.settings import RaySettings

pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'opus[ray]'); make test installs it")
REPO = Path(__file__).resolve().parents[2]


def test_an_unreachable_cluster_is_one_clear_error() -> None:
    with pytest.raises(ClusterError, match=r"run.executor.ray.address 'ray://127.0.0.1:9': cannot start or reach"):
        RayPool(RaySettings(address="ray://127.0.0.1:9"))


def test_a_cluster_lost_mid_way_ends_the_work_with_a_clear_error(tmp_path: Path) -> None:
    """The control store is killed while a task runs: the wait notices within its health check, and
    closing does not hang on Ray's own reconnect timeout. In a child process (see lost_cluster.py)."""
    # A session of its own: on losing the cluster the pool stops the Ray processes of its process group.
    done = subprocess.run([sys.executable, "-m", "tests.cluster.lost_cluster", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["killed"], "the slow task never started, so nothing was lost"
    assert re.search(r"was lost mid-way .*opus resume", outcome["error"] or ""), outcome
    assert outcome["seconds_after_kill"] < 30  # not the task's minute, nor Ray's own reconnect timeout


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
