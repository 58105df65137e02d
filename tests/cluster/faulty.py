"""Cluster tasks that fail on purpose (opus.cluster.ray_pool's retries and lost-cluster handling).

``meta`` is a directory: a task leaves a marker there on its first attempt, so the retry succeeds."""

from __future__ import annotations

import os
import time
from pathlib import Path


def flaky(meta: str, blob: bytes, payload: str) -> str:
    """Fails its first attempt: ``die`` kills the worker, anything else raises."""
    marker = Path(meta) / f"{payload}.tried"
    if not marker.exists():
        marker.write_text("tried")
        if payload == "die":
            os._exit(1)
        raise RuntimeError(f"planted failure {payload}")
    return payload.upper() + f" {len(blob)}"


def always(meta: str, blob: bytes, payload: str) -> str:
    raise ValueError(f"always fails: {payload}")


def slow(meta: str, blob: bytes, payload: str) -> str:
    (Path(meta) / "slow.started").write_text("started")
    time.sleep(60)
    return payload
