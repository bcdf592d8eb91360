"""A run's schedule: the task's questions, which prompt groups each step uses, how they are cut
into leases (and what a worker hands back for one), and the seed of the held-out evaluations.

Pure functions of (step, run seed): the controller of a Ray job and the in-process loop
(``cluster/local_run.py``) issue the same leases and evaluations, so both train on the same groups
with the same tree-search seeds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from treegrpo_ray.config import JobConfig, TaskConfig
from treegrpo_ray.engine import EngineCounters
from treegrpo_ray.envs.base import Sample, Task
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.envs.search_qa import SearchQATask
from treegrpo_ray.tree import BatchInfo


@dataclass(frozen=True)
class Lease:
    """Prompt groups handed to one worker: ``groups`` pairs a run-unique group id with its sample;
    ``seed`` fixes the tree search and sampling of this lease."""

    lease_id: int
    groups: tuple[tuple[int, Sample], ...]
    seed: int


@dataclass(frozen=True)
class LeaseReceipt:
    """What the controller reads of a finished lease without fetching its trees: the batch's
    info, the worker engine's cache counters (``Engine.cache_stats``) and the worker process's
    peak resident memory (``metrics.peak_rss_bytes``)."""

    info: BatchInfo
    cache: EngineCounters
    peak_rss_bytes: int = 0


def load_task(task: TaskConfig) -> Task:
    """The questions of the task named by the config."""
    if task.name == "search_qa":
        return SearchQATask(task.search_qa)
    return MultihopTask(task.multihop)


def eval_seed(run_seed: int) -> int:
    """Seed of every held-out evaluation of a run (the same questions and samples each time)."""
    return run_seed + 104729


def training_order(num_samples: int, seed: int) -> list[int]:
    """The order in which the run visits the train samples (reshuffled by nothing else)."""
    order = list(range(num_samples))
    random.Random(seed).shuffle(order)
    return order


def leases_of_step(cfg: JobConfig, samples: list[Sample]) -> Callable[[int], list[Lease]]:
    """The run's schedule: a step's leases, a function of the step and the run's seed only (the
    Ray job's controller and the in-process run both lease from it)."""
    train = cfg.train
    order = training_order(len(samples), train.seed)

    def leases(step: int) -> list[Lease]:
        return step_leases(
            samples, order, step, train.prompts_per_step, cfg.lease_size(), train.seed
        )

    return leases


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
