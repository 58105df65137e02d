"""Tasks on a Ray cluster: connect, share data once, run one task per payload, retry what fails.

A task is a plain function named ``"module:function"`` that takes ``(meta: str, blob: bytes,
payload: str)`` and returns a string, so nothing but text and bytes crosses the wire (opus.cluster.wire).
The shared ``(meta, blob)`` goes into the object store once; each task gets a reference.

Faults: a task that raises, or whose worker or node dies, is submitted again up to ``task_retries``
times, each retry reported through ``on_event`` (the run's events.jsonl); past that the stage fails
with the task's error. A cluster that cannot be reached, or is lost mid-way, is a ``ClusterError``:
the units finished so far are already on disk (opus.pipeline.units), so ``opus resume`` goes on.
"""

from __future__ import annotations

import importlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opus.cluster.settings import RAY_MISSING, RaySettings
from opus.errors import OpusError

OnEvent = Callable[[str, dict[str, Any]], None]
HEALTH_EVERY_S = 10.0  # how often a wait with nothing finished checks that the cluster is still there
HEALTH_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 20.0


class ClusterError(RuntimeError):
    """The cluster could not be reached or was lost, or a task failed past its retries.

    Not an OpusError (bad input, the same on every attempt): the run counts it as a crash, which a
    retry or ``opus resume`` runs again, with the units finished so far."""


@dataclass
class Finished:
    index: int  # the payload's position
    result: str
    where: str  # "host pid N (node abcd1234)"
    attempts: int


def _call(function: str, meta: str, blob: bytes, payload: str, threads: int) -> tuple[str, str]:
    """What runs on a worker: the named function, and where it ran."""
    import ray
    import torch

    torch.set_num_threads(threads)
    module, _, name = function.partition(":")
    result = getattr(importlib.import_module(module), name)(meta, blob, payload)
    node = ray.get_runtime_context().get_node_id()[:8]
    return result, f"{socket.gethostname()} pid {os.getpid()} (node {node})"


def _within(seconds: float, call: Callable[[], Any], default: Any = None) -> Any:
    """``call()``'s value, or ``default`` if it raised or did not return in time (it runs on in a daemon thread)."""
    box: list[Any] = []

    def run() -> None:
        try:
            value = call()
            box.append(True if value is None else value)
        except Exception:  # noqa: BLE001 - a failed answer reads as no answer
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else default


def _stop_orphans() -> None:
    """Ray processes an instance of ours left behind when it was lost (its agents outlive their raylet):
    in this process group, Ray's by their names. Only called for an instance this process started."""
    import psutil  # a dependency of Ray

    group, me = os.getpgrp(), os.getpid()
    for proc in psutil.process_iter(["name"]):
        try:
            name = proc.info["name"] or ""
            ours = proc.pid != me and os.getpgid(proc.pid) == group
            if ours and (name.startswith("ray::") or name in ("raylet", "gcs_server")):
                proc.kill()
        except (psutil.Error, OSError):
            continue


def _first_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError wraps what the task raised
    text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(exc)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _too_wide(nodes: list[dict[str, Any]], settings: RaySettings) -> str | None:
    """Why no live node can hold one task (its CPUs or GPUs), or None."""
    for key, asked in (("CPU", settings.num_cpus_per_task), ("GPU", settings.num_gpus_per_task)):
        widest = max((n.get("Resources", {}).get(key, 0.0) for n in nodes if n.get("Alive")), default=0.0)
        if asked > widest:
            return (f"run.executor.ray.num_{key.lower()}s_per_task is {asked:g}, but the largest node of the "
                    f"cluster has {widest:g} {key}s")
    return None


class RayPool:
    """A connection to a cluster for one stretch of work (``with ray_pool(settings) as pool``)."""

    def __init__(self, settings: RaySettings, on_event: OnEvent | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ClusterError(RAY_MISSING) from None
        self.ray, self.settings = ray, settings
        self.on_event = on_event or (lambda _name, _fields: None)
        self.started_here, self.lost = not ray.is_initialized(), False
        if self.started_here:
            self._connect()
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        too_wide = _too_wide(ray.nodes(), settings)
        if too_wide:  # Ray would wait forever for a node that can hold one task; the same on every attempt
            self.close()
            raise OpusError(too_wide)
        self.slots = settings.max_concurrency or max(1, int(cpus // settings.num_cpus_per_task))
        self.threads = max(1, int(settings.num_cpus_per_task))
        self._remote = ray.remote(_call).options(num_cpus=settings.num_cpus_per_task,
                                                 num_gpus=settings.num_gpus_per_task, max_retries=0)
        self.on_event("cluster_connected", {"address": settings.address, "cpus": cpus, "slots": self.slots,
                                            "nodes": sum(1 for n in ray.nodes() if n.get("Alive"))})

    def _connect(self) -> None:
        address = self.settings.address
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "logging_level": "error"}
        if address == "local":
            kwargs["num_cpus"] = self.settings.local_cpus or os.cpu_count()
        else:
            kwargs["address"] = address
        try:
            self.ray.init(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure to connect reads the same to a person
            raise ClusterError(f"run.executor.ray.address {address!r}: cannot start or reach a Ray cluster: "
                               f"{_first_line(exc)}") from None

    def share(self, meta: str, blob: bytes) -> tuple[str, Any]:
        """Put data every task reads into the object store, once."""
        return meta, self.ray.put(blob)

    def run(self, function: str, shared: tuple[str, Any], payloads: list[str]) -> Iterator[Finished]:
        """Each payload's result as it finishes (in any order); at most ``slots`` in flight."""
        ray = self.ray
        meta, blob = shared
        queue, attempts = deque(range(len(payloads))), [0] * len(payloads)
        pending: dict[Any, int] = {}
        while queue or pending:
            while queue and len(pending) < self.slots:
                index = queue.popleft()
                attempts[index] += 1
                pending[self._remote.remote(function, meta, blob, payloads[index], self.threads)] = index
            ready = self._wait(list(pending))
            for ref in ready:
                index = pending.pop(ref)
                try:
                    result, where = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.WorkerCrashedError,
                        ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError) as exc:
                    self._retry_or_fail(index, attempts[index], exc)
                    queue.appendleft(index)
                    continue
                except ray.exceptions.RaySystemError as exc:
                    raise self._lost(exc) from None
                yield Finished(index, result, where, attempts[index])

    def _wait(self, refs: list[Any]) -> list[Any]:
        """Wait for at least one task, checking now and then that the cluster is still there."""
        while True:
            try:
                ready, _ = self.ray.wait(refs, num_returns=1, timeout=HEALTH_EVERY_S)
            except Exception as exc:  # noqa: BLE001
                raise self._lost(exc) from None
            if ready:
                return ready
            self._check_alive()

    def _check_alive(self) -> None:
        """The cluster's control store answers, and a node is alive. Ray itself retries a lost control
        store for minutes, so each question has its own deadline."""
        address = getattr(self.ray.get_runtime_context(), "gcs_address", None)
        if address:
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=HEALTH_TIMEOUT_S).close()
            except OSError as exc:
                raise self._lost(exc) from None
        nodes = _within(HEALTH_TIMEOUT_S, self.ray.nodes)
        if nodes is None:
            raise self._lost(TimeoutError(f"the cluster did not answer within {HEALTH_TIMEOUT_S:g} s"))
        if not any(n.get("Alive") for n in nodes):
            raise self._lost(RuntimeError("no node of the cluster is alive"))

    def _retry_or_fail(self, index: int, attempt: int, exc: BaseException) -> None:
        error = _first_line(exc)
        if attempt > self.settings.task_retries:
            raise ClusterError(f"a task failed {attempt} times (run.executor.ray.task_retries is "
                               f"{self.settings.task_retries}); the last error: {error}")
        self.on_event("cluster_task_retried", {"task": index, "attempt": attempt, "error": error})

    def _lost(self, exc: BaseException) -> ClusterError:
        self.lost = True
        return ClusterError(f"the Ray cluster at {self.settings.address!r} was lost mid-way ({_first_line(exc)}); "
                            "the units finished so far are kept: `opus resume` goes on from them")

    def close(self) -> None:
        if not self.started_here:
            return
        done = _within(SHUTDOWN_TIMEOUT_S, self.ray.shutdown, default=False)
        if done is False or self.lost:
            _stop_orphans()

@contextmanager
def ray_pool(settings: RaySettings, on_event: OnEvent | None = None) -> Iterator[RayPool]:
    started = time.monotonic()
    pool = RayPool(settings, on_event)
    try:
        yield pool
    finally:
        pool.close()
        pool.on_event("cluster_released", {"seconds": round(time.monotonic() - started, 1)})
