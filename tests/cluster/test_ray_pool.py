"""Tasks on a local two-CPU Ray cluster: results, bounded retries, a lost cluster (opus.cluster.ray_pool)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opus.cluster.ray_pool import ClusterError, RayPool, ray_pool
from opus.cluster.settings import RaySettings

pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'opus[ray]'); make test installs it")
TASKS = "tests.cluster.faulty"


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[RayPool, list[tuple[str, dict[str, Any]]]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    with ray_pool(RaySettings(local_cpus=2, task_retries=1), lambda name, fields: events.append((name, fields))) as p:
        yield p, events


def test_each_payload_comes_back_once_with_where_it_ran(pool, tmp_path: Path) -> None:  # noqa: ANN001
    p, events = pool
    assert events[0][0] == "cluster_connected" and events[0][1]["cpus"] == 2 and p.slots == 2
    shared = p.share(str(tmp_path), b"12345")
    (tmp_path / "x.tried").write_text("")  # no failure planted: every payload passes at once
    (tmp_path / "y.tried").write_text("")
    done = sorted(p.run(f"{TASKS}:flaky", shared, ["x", "y"]), key=lambda f: f.index)
    assert [(f.index, f.result, f.attempts) for f in done] == [(0, "X 5", 1), (1, "Y 5", 1)]
    assert all(" pid " in f.where and "(node " in f.where for f in done)


def test_a_task_that_raises_or_whose_worker_dies_is_retried_and_reported(pool, tmp_path: Path) -> None:  # noqa: ANN001
    p, events = pool
    events.clear()
    done = {f.index: f for f in p.run(f"{TASKS}:flaky", p.share(str(tmp_path), b""), ["a", "die"])}
    assert {i: (f.result, f.attempts) for i, f in done.items()} == {0: ("A 0", 2), 1: ("DIE 0", 2)}
    retried = {fields["task"]: fields for name, fields in events if name == "cluster_task_retried"}
    assert sorted(retried) == [0, 1]
    assert "planted failure a" in retried[0]["error"]
    assert "died" in retried[1]["error"]


def test_a_task_failing_past_its_retries_fails_the_work_with_its_error(pool, tmp_path: Path) -> None:  # noqa: ANN001
    p, _ = pool
    with pytest.raises(ClusterError, match=r"failed 2 times .*task_retries is 1.*ValueError: always fails: z"):
        list(p.run(f"{TASKS}:always", p.share(str(tmp_path), b""), ["z"]))
