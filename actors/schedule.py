"""A run's schedule: which prompt groups each step uses, how they are cut into leases, and the
seed of the held-out evaluations.

Pure functions of (step, run seed): the controller of a Ray job and the in-process loop
(``cluster/local_run.py``) issue the same leases and evaluations, so both train on the same groups
with the same tree-search seeds.
"""

from __future__ import annotations

import random

from actors.rollout_worker import Lease
from treegrpo_ray.envs.base import Sample


def eval_seed(run_seed: int) -> int:
    """Seed of every held-out evaluation of a run (the same questions and samples each time)."""
    return run_seed + 104729


def training_order(num_samples: int, seed: int) -> list[int]:
    """The order in which the run visits the train samples (reshuffled by nothing else)."""
    order = list(range(num_samples))
    random.Random(seed).shuffle(order)
    return order


def step_leases(
    samples: list[Sample],
    order: list[int],
    step: int,
    prompts_per_step: int,
    lease_size: int,
    seed: int,
) -> list[Lease]:
    """The leases of ``step`` (0-based): groups ``step * prompts_per_step ...`` in ``order``,
    ``lease_size`` per lease; group ids are run-unique, lease seeds depend on the lease id only."""
    count = prompts_per_step // lease_size
    leases = []
    for j in range(count):
        first = step * prompts_per_step + j * lease_size
        groups = tuple(
            (g, samples[order[g % len(order)]]) for g in range(first, first + lease_size)
        )
        lease_id = step * count + j
        leases.append(Lease(lease_id, groups, seed=seed * 7919 + lease_id))
    return leases
