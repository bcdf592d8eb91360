"""``python -m cluster.scale RUN K``: resize run RUN's rollout pool to K workers.

``treegrpo scale`` submits this as a short Ray job, so it reaches the cluster through the same
dashboard address and token as ``submit``; here, on the cluster, it finds the run's controller
(a named actor) and asks it to scale. Prints the controller's answer as one JSON line.
"""

from __future__ import annotations

import json
import sys

import ray

from cluster.controller import NAMESPACE, controller_name


def main(argv: list[str]) -> int:
    run, workers = argv[0], int(argv[1])
    ray.init(address="auto", namespace=NAMESPACE, logging_level="ERROR")
    try:
        controller = ray.get_actor(controller_name(run), namespace=NAMESPACE)
    except ValueError:
        print(f"treegrpo: error: no running treegrpo job named {run} on this cluster")
        return 2
    try:
        result = ray.get(controller.scale.remote(workers))
    except ray.exceptions.RayTaskError as err:  # e.g. new workers that cannot be placed
        print(f"treegrpo: error: cannot scale {run}: {err.cause}")
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
