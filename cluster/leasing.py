"""Lease scheduling: which leases are due, which worker runs each, what came back.

Leases: each step's prompt groups are cut into leases of ``JobConfig.lease_size()`` groups; a
lease's groups and seed depend only on the step and the run's seed, so any worker can run it.
``issue`` calls ``worker.expand_leased.remote(lease)`` from the controller itself: the controller
owns every tree batch, and ``settle`` hands one on only when its receipt (a small separate object)
says the lease succeeded. A lease whose worker died goes back to the front of the backlog; Ray
restarts the worker, which gets the current policy before its next lease. Every prompt group thus
reaches the learner once.

Streaming: the leases of step ``s`` are due once the learner's version is at least
``s - max_policy_lag``; a new version is sent to each worker before its next lease, so with a lag
of 1 or more the workers keep generating while the learner trains.

A plain class without threads or locks of its own: the controller calls it under its lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import ray
from ray.exceptions import OutOfMemoryError, RayActorError

from treegrpo_ray.actors.schedule import Lease, LeaseReceipt, step_leases, training_order
from treegrpo_ray.cluster.rollout_pool import RolloutPool
from treegrpo_ray.config import JobConfig
from treegrpo_ray.envs.base import Sample


@dataclass
class InFlight:
    """A lease being expanded: which worker runs it and the ref of its tree batch."""

    lease: Lease
    worker_id: int
    trees: ray.ObjectRef


class LeaseScheduler:
    """The backlog of due leases and the leases in flight, by receipt ref."""

    def __init__(self, cfg: JobConfig, pool: RolloutPool, samples: list[Sample], first_step: int):
        self.cfg = cfg
        self.pool = pool
        self.samples = samples
        self.order = training_order(len(samples), cfg.train.seed)
        self.next_step = first_step
        self.backlog: collections.deque[Lease] = collections.deque()
        self.in_flight: dict[ray.ObjectRef, InFlight] = {}
        self.busy_s = 0.0  # rollout seconds of the leases settled since ``take_busy_seconds``
        self.worker_cache: dict[int, dict[str, float]] = {}  # each worker's last cache counters
        self.peak_rss_bytes = 0  # the most memory a rollout worker process held

    def plan(self, version: int) -> None:
        """Queue the leases of every step the staleness bound allows at policy ``version``."""
        train = self.cfg.train
        while self.next_step < train.steps and version >= self.next_step - train.max_policy_lag:
            self.backlog.extend(self._leases(self.next_step))
            self.next_step += 1

    def _leases(self, step: int) -> list[Lease]:
        """The leases of ``step``: a function of the step and the run's seed only."""
        train = self.cfg.train
        return step_leases(
            self.samples,
            self.order,
            step,
            train.prompts_per_step,
            self.cfg.lease_size(),
            train.seed,
        )

    def issue(self, version: int, weights: ray.ObjectRef | None) -> bool:
        """Give the next leases to workers without one, each on policy ``version`` first;
        True when any lease was issued."""
        self.pool.check_probes()
        busy = {item.worker_id for item in self.in_flight.values()}
        issued = False
        for worker_id in self.pool.usable():
            if not self.backlog:
                break
            if worker_id in busy:
                continue
            self._bring_up_to_date(worker_id, version, weights)
            lease = self.backlog.popleft()
            handle = self.pool.workers[worker_id].handle
            receipt, trees = handle.expand_leased.options(num_returns=2).remote(lease)
            self.in_flight[receipt] = InFlight(lease, worker_id, trees)
            issued = True
        return issued

    def _bring_up_to_date(self, worker_id: int, version: int, weights: ray.ObjectRef | None):
        worker = self.pool.workers[worker_id]
        if worker.version == version:
            return
        if weights is None:  # nothing published yet: every instance starts on it
            worker.version = version
        else:
            self.pool.sync(worker_id, version, weights)

    def settle(
        self, ref: ray.ObjectRef, receipt: LeaseReceipt | RayActorError | OutOfMemoryError
    ) -> InFlight | None:
        """Book a finished lease: its ``InFlight`` when the batch is good to enqueue; None when
        its worker died or Ray's memory monitor killed it (the lease goes back to the front of
        the backlog) or a rewind dropped it."""
        item = self.in_flight.pop(ref, None)
        if item is None:
            return None
        if isinstance(receipt, (RayActorError, OutOfMemoryError)):
            self.backlog.appendleft(item.lease)
            self.pool.lost_lease(item.worker_id, receipt)
            return None
        self.busy_s += receipt.info.rollout_seconds
        self.worker_cache[item.worker_id] = receipt.cache
        self.peak_rss_bytes = max(self.peak_rss_bytes, receipt.peak_rss_bytes)
        return item

    def holds_lease(self, worker_id: int) -> bool:
        return any(item.worker_id == worker_id for item in self.in_flight.values())

    def rewind(self, step: int) -> None:
        """Forget the backlog and the leases in flight; plan again from ``step``."""
        self.in_flight.clear()
        self.backlog.clear()
        self.next_step = step

    def take_busy_seconds(self) -> float:
        busy, self.busy_s = self.busy_s, 0.0
        return busy
