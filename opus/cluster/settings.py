"""``run.executor`` in a pipeline: ``local`` (the default) or ``{ray: {...}}``."""

from __future__ import annotations

import importlib.util

from pydantic import BaseModel, ConfigDict, Field

RAY_MISSING = "Ray is not installed here: pip install 'opus[ray]' (or set run.executor: local)"


class RaySettings(BaseModel):
    """Where the plan stage's sensitivity sweep runs when it fans out (opus.cluster.ray_pool)."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field("local", description="local: start a Ray instance on this machine for the stage; auto: "
                         "join the cluster this machine belongs to (RAY_ADDRESS or a running `ray start`); "
                         "ray://host:10001 (Ray client) or host:6379: that cluster")
    num_cpus_per_task: float = Field(1.0, gt=0, description="CPUs each task reserves; its torch threads too")
    num_gpus_per_task: float = Field(0.0, ge=0, description="GPUs each task reserves (the model stays on the "
                                     "device the pipeline names)")
    max_concurrency: int | None = Field(None, gt=0, description="tasks in flight at once (default: as many as "
                                        "the cluster's CPUs hold)")
    task_retries: int = Field(2, ge=0, le=10, description="times a task that raised or whose worker died is "
                              "submitted again before the stage fails")
    units_per_task: int | None = Field(None, gt=0, description="sweep units per task (default: about four tasks "
                                       "per slot, so a retry or a kill loses little)")
    local_cpus: int | None = Field(None, gt=0, description="address local: the CPUs the local instance offers "
                                   "(default: all of this machine's)")


class ExecutorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ray: RaySettings


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None
