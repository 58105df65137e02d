"""A Ray cluster lost mid-way, acted out in a process of its own: ``python -m tests.cluster.lost_cluster DIR``.

After its control store dies, Ray's driver state is not fit to start another cluster in the same
process (a shutdown left running in a thread, or a driver that exits when its store stays away), so
the test that loses a cluster must not share its process with the tests that use one. Prints one
JSON line: the error the work ended with and how long it took."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import psutil

from opus.cluster import ray_pool as pool_module
from opus.cluster.ray_pool import ClusterError, ray_pool
from opus.cluster.settings import RaySettings

TASKS = "tests.cluster.faulty"
WAIT_FOR_TASK_S = 120  # a busy machine starts a Ray worker slowly


def kill_own_control_store(started: Path, killed: list[float]) -> None:
    """Once the task runs, SIGKILL the gcs_server this process started (no other cluster's)."""
    deadline = time.monotonic() + WAIT_FOR_TASK_S
    while not started.exists():
        if time.monotonic() > deadline:
            return  # the task never ran: the parent test reports that, nothing is killed
        time.sleep(0.1)
    for child in psutil.Process().children(recursive=True):
        if child.name() == "gcs_server":
            child.kill()
            killed.append(time.monotonic())


def main(meta: Path) -> None:
    pool_module.HEALTH_EVERY_S = 1.0
    pool_module.SHUTDOWN_TIMEOUT_S = 5.0
    killed: list[float] = []
    outcome: dict[str, object] = {"error": None}
    try:
        with ray_pool(RaySettings(local_cpus=1)) as pool:
            threading.Thread(target=kill_own_control_store, args=(meta / "slow.started", killed),
                             daemon=True).start()
            list(pool.run(f"{TASKS}:slow", pool.share(str(meta), b""), ["s"]))
    except ClusterError as exc:
        outcome["error"] = str(exc)
    outcome["killed"] = bool(killed)
    outcome["seconds_after_kill"] = round(time.monotonic() - killed[0], 1) if killed else None
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
