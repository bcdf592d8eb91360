"""Held-out evaluation of one policy version on the rollout workers, off the learner's path.

The controller starts an evaluation when the learner publishes a version that is due for one and
returns at once; the learner goes on training. Each shard of the held-out questions is sent to a
worker right after that worker is given the evaluated version (``load_weights`` of the version's
snapshot if the worker is on another one), and calls to one actor run in the order they are sent:
so every shard measures exactly that version, even when a lease moves the worker on to a
newer policy right after. A shard whose worker dies is sent again to another worker.

A snapshot's weights are an object of the learner that published them, and Ray drops an object
with its owner's process: so the learner waits for the pending evaluations before it exits
(``Controller.evaluations_finished``), and a worker whose load of the snapshot failed refuses
its shard rather than measure the policy it still holds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
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
    """Runs measurements of a snapshot on the job's rollout workers, as a task on the
    controller's event loop.

    ``workers_on(snapshot)``: the handles of the usable workers, each sent the snapshot's policy
    first if it holds another (none when no weights can be sent). Its sends and the shards sent
    after them are made without yielding to the loop, so no lease of the loop's comes between.
    ``kept`` is a context manager inside which no scaled-down worker is stopped (it would lose
    its shard); ``changed(timeout)`` waits up to ``timeout`` s for the job to change (a worker
    that answers again)."""

    def __init__(
        self,
        heldout: list[Sample],
        seed: int,
        workers_on: Callable[[Snapshot], list[Any]],
        kept: Callable[[], AbstractContextManager[None]],
        changed: Callable[[float], Awaitable[None]],
    ):
        self.heldout = heldout
        self.seed = seed
        self.workers_on = workers_on
        self.kept = kept
        self.changed = changed

    async def measure(
        self, snapshot: Snapshot, measurements: list[Measurement]
    ) -> dict[str, float]:
        """Every measurement of ``snapshot``, by key, plus ``eval/policy_version``."""
        with self.kept():
            result = {m.key: await self._success_rate(snapshot, m) for m in measurements}
        return {**result, "eval/policy_version": float(snapshot.version)}

    async def _success_rate(self, snapshot: Snapshot, measurement: Measurement) -> float:
        samples = self.heldout[: measurement.questions]
        workers = await self._wait_for_workers(snapshot)
        shards = [samples[i :: len(workers)] for i in range(len(workers))]
        results: dict[int, list[float]] = {}
        todo = list(range(len(shards)))
        for attempt in range(SHARD_ATTEMPTS):
            if attempt:  # a worker died: ask again which ones are on the snapshot
                workers = await self._wait_for_workers(snapshot)
            sent = self._send(workers, snapshot, measurement, shards, todo)
            answers = await asyncio.gather(*sent, return_exceptions=True)
            todo = []
            for shard, answer in zip(sent.values(), answers, strict=True):
                if isinstance(answer, (RayActorError, OutOfMemoryError)):
                    todo.append(shard)  # its worker died: sent again
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    results[shard] = answer
            if not todo:
                return statistics.fmean(x for shard in results.values() for x in shard)
        raise RuntimeError(
            f"held-out evaluation of policy version {snapshot.version} failed: its workers died "
            f"{SHARD_ATTEMPTS} times; see the rollout workers' logs"
        )

    def _send(
        self,
        workers: list[Any],
        snapshot: Snapshot,
        measurement: Measurement,
        shards: list[list[Sample]],
        todo: list[int],
    ) -> dict[ray.ObjectRef, int]:
        """Send the shards in ``todo`` round-robin to ``workers`` (handles of workers on the
        snapshot, from ``_wait_for_workers`` with no await between: no lease comes first); each
        worker checks that it holds the snapshot's version."""
        return {
            workers[i % len(workers)].evaluate.remote(
                shards[shard], measurement.temperature, self.seed, snapshot.version
            ): shard
            for i, shard in enumerate(todo)
        }

    async def _wait_for_workers(self, snapshot: Snapshot) -> list[Any]:
        """``workers_on``, waiting while there is none (all may be restarting)."""
        deadline = time.monotonic() + WORKER_WAIT_S
        while not (workers := self.workers_on(snapshot)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"no rollout worker could evaluate policy version {snapshot.version} within "
                    f"{WORKER_WAIT_S} s; see the rollout workers' logs"
                )
            await self.changed(remaining)
        return workers
