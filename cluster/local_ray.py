"""Starting a local Ray instance on a machine the run shares with other programs.

Imports no Ray itself: ``keep_local_ray_on_loopback`` must run before Ray is imported."""

import os
import sys
from typing import Any

from treegrpo_ray.config import JobConfig

# Ray starts its workers at nice 15 (to keep its own daemons responsive on a busy node). On a
# machine the run shares, any other program then starves the rollout workers and learners (a vLLM
# engine host got 13% of a core beside two busy loops), so a local instance runs them at nice 0.
WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}

# Ray's single-machine mode (the one it uses on Windows and macOS): the node's address is
# 127.0.0.1, and Ray's servers (GCS, raylet, workers, agents) bind it instead of every interface.
# Ray reads it once, when it is imported; a process that joins a cluster must not have it.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def cluster_address(cfg: JobConfig) -> str | None:
    """The cluster a run joins: ``cluster.address``, or ``RAY_ADDRESS`` (set for a Ray Jobs
    entrypoint); None when it starts a local Ray of its own."""
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS")


def keep_local_ray_on_loopback() -> bool:
    """Every port of the Ray this process starts listens on the loopback interface only; False
    (and nothing changed) when Ray is imported already: it would not take effect (a caller
    inside a process that runs Ray, such as a test, keeps that Ray)."""
    if "ray" in sys.modules:
        return False
    os.environ.update(LOOPBACK_ENV)
    return True


def init_local_ray(**ray_init_kwargs: Any) -> None:
    """``ray.init(**ray_init_kwargs)`` starting a new local instance whose workers run at nice 0
    (unless ``RAY_worker_niceness`` is already set)."""
    import ray

    for name, value in WORKER_NICENESS_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(**ray_init_kwargs)
