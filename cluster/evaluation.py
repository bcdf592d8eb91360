"""Held-out evaluation of one policy version on the rollout workers, off the learner's path.

The controller starts an evaluation when the learner publishes a version that is due for one and
returns at once; the learner goes on training. Each shard of the held-out questions is sent to a
worker right after that worker is given the evaluated version (``load_weights`` of the version's
snapshot if the worker is on another one), and calls to one actor run in the order they are sent:
so every shard measures exactly that version, even when the lease loop moves the worker on to a
newer policy right after. A shard whose worker dies is sent again to another worker.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import OutOfMemoryError, RayActorError

from treegrpo_ray.envs.base import Sample

SHARD_ATTEMPTS = 3  # a shard is sent at most this often (its worker may die each time)
WORKER_WAIT_S = 600  # the longest wait for a usable worker (all of them may be restarting)


@dataclass(frozen=True)
class Measurement:
    """One held-out success rate: ``questions`` questions, one chain each at ``temperature``
    (greedy at 0), written as metric ``key``."""

    key: str
    questions: int
    temperature: float


@dataclass(frozen=True)
class Snapshot:
    """The policy an evaluation measures: ``version``, and its weights (None: the workers'
    initial policy, which every worker on ``version`` already holds)."""

    version: int
    weights: ray.ObjectRef | None


class Evaluator:
    """Runs measurements of a snapshot on the job's rollout workers.

    ``workers_on(snapshot)``: the handles of the usable workers, each sent the snapshot's policy
    first if it holds another (none when no weights can be sent); called under ``lock``, the
    controller's, so that an evaluation's calls and the lease loop's interleave in a known order.
    ``kept`` is a context manager inside which no scaled-down worker is stopped (it would lose
    its shard)."""

    def __init__(
        self,
        heldout: list[Sample],
        seed: int,
        workers_on: Callable[[Snapshot], list[Any]],
        lock: threading.Condition,
        kept: Callable[[], Any],
    ):
        self.heldout = heldout
        self.seed = seed
        self.workers_on = workers_on
        self.lock = lock
        self.kept = kept

    def measure(self, snapshot: Snapshot, measurements: list[Measurement]) -> dict[str, float]:
        """Every measurement of ``snapshot``, by key, plus ``eval/policy_version``."""
        with self.kept():
            result = {m.key: self._success_rate(snapshot, m) for m in measurements}
        return {**result, "eval/policy_version": float(snapshot.version)}

    def _success_rate(self, snapshot: Snapshot, measurement: Measurement) -> float:
        samples = self.heldout[: measurement.questions]
        with self.lock:
            workers = len(self._wait_for_workers(snapshot))
        shards = [samples[i::workers] for i in range(workers)]
        results: dict[int, list[float]] = {}
        todo = list(range(len(shards)))
        for _ in range(SHARD_ATTEMPTS):
            sent = self._send(snapshot, measurement, shards, todo)
            todo = []
            for ref, shard in sent.items():
                try:
                    results[shard] = ray.get(ref)
                except (RayActorError, OutOfMemoryError):
                    todo.append(shard)
            if not todo:
                return statistics.fmean(x for shard in results.values() for x in shard)
        raise RuntimeError(
            f"held-out evaluation of policy version {snapshot.version} failed: its workers died "
            f"{SHARD_ATTEMPTS} times; see the rollout workers' logs"
        )

    def _send(
        self,
        snapshot: Snapshot,
        measurement: Measurement,
        shards: list[list[Sample]],
        todo: list[int],
    ) -> dict[ray.ObjectRef, int]:
        """Send the shards in ``todo`` round-robin to the workers on ``snapshot``."""
        with self.lock:
            workers = self._wait_for_workers(snapshot)
            return {
                workers[i % len(workers)].evaluate.remote(
                    shards[shard], measurement.temperature, self.seed
                ): shard
                for i, shard in enumerate(todo)
            }

    def _wait_for_workers(self, snapshot: Snapshot) -> list[Any]:
        """``workers_on``, waiting while there is none (the caller holds the lock)."""
        deadline = time.monotonic() + WORKER_WAIT_S
        while not (workers := self.workers_on(snapshot)):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no rollout worker could evaluate policy version {snapshot.version} within "
                    f"{WORKER_WAIT_S} s; see the rollout workers' logs"
                )
            self.lock.wait(1.0)  # lets the lease loop bring restarted workers back
        return workers
