"""Starting a local Ray instance on a machine the run shares with other programs."""

import os
from typing import Any

import ray

# Ray starts its workers at nice 15 (to keep its own daemons responsive on a busy node). On a
# machine the run shares, any other program then starves the rollout workers and learners (a vLLM
# engine host got 13% of a core beside two busy loops), so a local instance runs them at nice 0.
WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}


def init_local_ray(**ray_init_kwargs: Any) -> None:
    """``ray.init(**ray_init_kwargs)`` starting a new local instance whose workers run at nice 0
    (unless ``RAY_worker_niceness`` is already set)."""
    for name, value in WORKER_NICENESS_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(**ray_init_kwargs)
