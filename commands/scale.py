"""``python -m treegrpo_ray.commands.scale RUN K [WAIT_S]``: resize run RUN's rollout pool to K workers.

``treegrpo scale`` submits this as a short Ray job, so it reaches the cluster through the same
dashboard address and token as ``submit``; here, on the cluster, it finds the run's controller
(a named actor; up to WAIT_S seconds for a job that is still starting) and asks it to scale.
Prints the controller's answer as one JSON line.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import ray

from treegrpo_ray.cluster.naming import NAMESPACE, controller_name

POLL_S = 0.5  # Ray has no way to wait for a named actor to appear


def _find_controller(run: str, wait_s: float) -> Any:
    """The controller actor of run ``run``, waiting up to ``wait_s`` s; None if there is none."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ray.get_actor(controller_name(run), namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    run, workers = argv[0], int(argv[1])
    wait_s = float(argv[2]) if len(argv) > 2 else 0.0
    ray.init(address="auto", namespace=NAMESPACE, logging_level=logging.ERROR)
    controller = _find_controller(run, wait_s)
    if controller is None:
        waited = f" (waited {wait_s:g} s for it to start)" if wait_s else ""
        print(f"treegrpo: error: no running treegrpo job named {run} on this cluster{waited}")
        return 2
    try:
        result = ray.get(controller.scale.remote(workers))
    except ray.exceptions.RayTaskError as err:  # e.g. new workers that cannot be placed
        print(f"treegrpo: error: cannot scale {run}: {err.cause}")
        return 2
    print(result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
