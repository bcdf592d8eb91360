"""The scheduling state of one training job, with no Ray and no threads.

Events go in as method calls: a lease's receipt, a worker that died, a probe's answer, a policy
published or restored, a scale request, a placement that failed, an evaluation starting and
ending. Each returns the typed commands that carry it out (send a policy to a worker, start a
lease, probe a worker, start or stop one, enqueue a batch, drop the queue), which the controller
(``cluster/controller.py``) executes on Ray. The state is therefore testable by replaying event
sequences in-process.

Leases: each step's prompt groups are cut into leases (``leases_of_step``); a lease's groups and
seed depend only on the step and the run's seed, so any worker can run it. An issued lease gets a
ticket; its batch is enqueued only when its receipt says it succeeded, and in lease order: the
learner takes each update's prompt groups from the head of the queue, so a batch of a later step
that finished first would fill an earlier update and leave the earlier step's batch to a later
update, too stale for it (dropped, its groups never redone). A lease whose worker died
goes back to the front of the backlog; a restarted worker takes no lease until a probe answers
and gets the current policy before its next one. Every prompt group thus reaches the learner
once, and a rewind (``restored``) drops the tickets in flight, so their late receipts are ignored.

Streaming: the leases of step ``s`` are due once the learner's version is at least
``s - max_policy_lag``; a new version is sent to each worker before its next lease, so with a lag
of 1 or more the workers keep generating while the learner trains.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

from treegrpo_ray.actors.schedule import Lease, LeaseReceipt
from treegrpo_ray.engine import EngineCounters

INITIAL = 0  # the version of the policy every worker starts on
UNKNOWN = -1  # the version of a restarted worker instance before it is synced


@dataclass(frozen=True)
class Failure:
    """Why a job stopped early: the part that stopped it and its one-line reason (what it
    kept, how to go on)."""

    source: Literal["learner", "rollout", "evaluation"]
    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class WorkerDeath:
    """How a rollout worker died: whether Ray restarts it (a fresh instance on the initial
    policy), a one-line reason, and whether Ray's memory monitor killed it."""

    restarting: bool
    reason: str
    memory_kill: bool = False


@dataclass(frozen=True)
class ScaleResult:
    """The answer to a scale request: the active workers, the newest policy version, and the
    versions the added workers loaded (each at most the newest: a version may be published
    while they are placed). It travels as one JSON line in the log of ``treegrpo scale``'s
    short job."""

    rollout_workers: int
    policy_version: int
    added_versions: list[int]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> ScaleResult:
        """Raises ValueError when ``line`` is not such an answer."""
        try:
            return cls(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"not a scale answer: {line!r}") from err


@dataclass(frozen=True)
class StartWorker:
    worker_id: int


@dataclass(frozen=True)
class StopWorker:
    """Stop the worker and free what it reserved."""

    worker_id: int


@dataclass(frozen=True)
class SendPolicy:
    """Load policy ``version`` on the worker, ordered before any later call to it."""

    worker_id: int
    version: int


@dataclass(frozen=True)
class Probe:
    """Ask a new or restarting worker whether it answers (``probe_answered`` / ``worker_lost``)."""

    worker_id: int


@dataclass(frozen=True)
class StartLease:
    ticket: int
    worker_id: int
    lease: Lease


@dataclass(frozen=True)
class Enqueue:
    """Put the batch of lease ``ticket`` in the learners' queue."""

    ticket: int


@dataclass(frozen=True)
class DrainQueue:
    """Drop every batch queued for the learners (a rewind)."""


Command = StartWorker | StopWorker | SendPolicy | Probe | StartLease | Enqueue | DrainQueue


@dataclass
class Worker:
    """A rollout worker as the job sees it: the policy version last sent to it, whether it is
    leaving the pool, whether it answers (False until a probe of a new or restarted instance
    does)."""

    version: int
    retiring: bool = False
    answering: bool = True


@dataclass(frozen=True)
class InFlight:
    lease: Lease
    worker_id: int


@dataclass
class RolloutCounters:
    """What the rollout side reports for the metrics: worker deaths (of which Ray's memory
    monitor killed), rollout seconds since ``take_busy_seconds``, each worker's last cache
    counters, the most memory a worker process held."""

    failures: int = 0
    memory_kills: int = 0
    last_failure: str = ""
    busy_s: float = 0.0
    worker_cache: dict[int, EngineCounters] = field(default_factory=dict)
    peak_rss_bytes: int = 0


class JobState:
    """Backlog, leases in flight, the workers and their versions, retirement, evaluations,
    consumed groups and the failure of one job (see module docstring).

    ``leases_of_step(step)``: the leases of a step; ``steps``: the job's last policy version;
    ``max_restarts``: how often Ray restarts a worker; ``resume_from``: the version a resumed run continues from (no lease is issued until the
    learner has sent it: ``restored``)."""

    def __init__(
        self,
        leases_of_step: Callable[[int], list[Lease]],
        steps: int,
        max_policy_lag: int,
        max_restarts: int,
        resume_from: int | None = None,
    ):
        self.leases_of_step = leases_of_step
        self.steps = steps
        self.max_policy_lag = max_policy_lag
        self.max_restarts = max_restarts  # of each worker; for the error when none is left
        self.version = resume_from or INITIAL
        self.policy_sent = False  # whether any policy was published (else the initial one)
        self.policy_ready = resume_from is None
        self.next_step = self.version
        self.backlog: collections.deque[Lease] = collections.deque()
        self.in_flight: dict[int, InFlight] = {}
        self.unqueued: collections.deque[int] = collections.deque()  # lease ids, in step order
        self.held: dict[int, int] = {}  # lease id -> ticket: done, waiting for earlier leases
        self.next_ticket = 0
        self.workers: dict[int, Worker] = {}
        self.next_worker_id = 0  # ids grow; a retired id is never reused
        self.evaluations_running = 0  # a retiring worker is only stopped when this is 0
        self.consumed: dict[int, list[int]] = {}  # policy version -> groups its update used
        self.counters = RolloutCounters()
        self.failure: Failure | None = None

    # --- workers ------------------------------------------------------------------------------

    def add_workers(self, count: int, probe: bool = False) -> list[Command]:
        """Start ``count`` workers on the newest policy. ``probe``: each takes a lease only
        after it answers (a worker added while the job runs, whose placement may take a
        while)."""
        commands: list[Command] = []
        for _ in range(count):
            worker_id, self.next_worker_id = self.next_worker_id, self.next_worker_id + 1
            self.workers[worker_id] = Worker(INITIAL, answering=not probe)
            commands.append(StartWorker(worker_id))
            if self.policy_sent:
                commands.append(self._send(worker_id, self.version))
            if probe:
                commands.append(Probe(worker_id))
        return commands

    def placement_failed(self, worker_ids: list[int]) -> list[Command]:
        """Workers that could not be placed are given up."""
        return [self._remove(w) for w in worker_ids if w in self.workers]

    def shrink_to(self, count: int) -> list[Command]:
        """Retire the active workers after the first ``count``: each finishes the lease it
        holds (its batch is enqueued) and is stopped once no evaluation runs."""
        for worker_id in self.active()[count:]:
            self.workers[worker_id].retiring = True
        return self._retire_idle()

    def probe_answered(self, worker_id: int) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].answering = True

    def worker_lost(self, worker_id: int, death: WorkerDeath) -> list[Command]:
        """A worker died. One that Ray restarts takes no lease until a probe answers and is
        synced first; otherwise it leaves the pool. Raises RuntimeError when none is left."""
        self.counters.failures += 1
        self.counters.memory_kills += int(death.memory_kill)
        self.counters.last_failure = death.reason
        if worker_id not in self.workers:
            return []
        if death.restarting:
            worker = self.workers[worker_id]
            worker.version, worker.answering = UNKNOWN, False
            return [Probe(worker_id)]
        command = self._remove(worker_id)
        if not self.workers:
            raise RuntimeError(
                "every rollout worker died and cannot be restarted (cluster.rollout_max_restarts "
                f"= {self.max_restarts}); the last: {death.reason}"
            )
        return [command]

    def active(self) -> list[int]:
        """Ids of the workers that take new leases."""
        return [i for i, w in self.workers.items() if not w.retiring]

    def usable(self) -> list[int]:
        """Active workers that answer."""
        return [i for i in self.active() if self.workers[i].answering]

    def busy_workers(self) -> set[int]:
        return {item.worker_id for item in self.in_flight.values()}

    # --- leases -------------------------------------------------------------------------------

    def next_leases(self) -> list[Command]:
        """Plan the steps the staleness bound allows, then give the next leases to usable
        workers without one, each brought to the newest policy first."""
        if not self.policy_ready:
            return []
        while self.next_step < self.steps and self.version >= self.next_step - self.max_policy_lag:
            leases = self.leases_of_step(self.next_step)
            self.backlog.extend(leases)
            self.unqueued.extend(lease.lease_id for lease in leases)
            self.next_step += 1
        commands: list[Command] = []
        busy = self.busy_workers()
        for worker_id in self.usable():
            if not self.backlog:
                break
            if worker_id in busy:
                continue
            commands.extend(self._bring_up_to_date(worker_id))
            ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
            lease = self.backlog.popleft()
            self.in_flight[ticket] = InFlight(lease, worker_id)
            commands.append(StartLease(ticket, worker_id, lease))
        return commands

    def lease_done(self, ticket: int, receipt: LeaseReceipt) -> list[Command]:
        """A lease succeeded: its batch is enqueued once every earlier lease's is (unless a
        rewind dropped the lease); a retiring worker that held it may stop."""
        item = self.in_flight.pop(ticket, None)
        if item is None:
            return []
        self.counters.busy_s += receipt.info.rollout_seconds
        self.counters.worker_cache[item.worker_id] = receipt.cache
        self.counters.peak_rss_bytes = max(self.counters.peak_rss_bytes, receipt.peak_rss_bytes)
        self.held[item.lease.lease_id] = ticket
        return [*self._enqueue_in_order(), *self._retire_idle()]

    def lease_lost(self, ticket: int, death: WorkerDeath) -> list[Command]:
        """The worker running lease ``ticket`` died: the lease goes back to the front of the
        backlog (``worker_lost`` says what becomes of the worker; a retiring one is stopped)."""
        item = self.in_flight.pop(ticket, None)
        if item is None:
            return []
        self.backlog.appendleft(item.lease)
        return [
            *self.worker_lost(item.worker_id, death),
            *self._retire_idle(),
        ]

    # --- policy versions ----------------------------------------------------------------------

    def published(self, version: int, groups: list[int]) -> None:
        """The learner published ``version``, whose update consumed ``groups``."""
        self.version, self.policy_sent = version, True
        self.consumed[version] = list(groups)

    def restored(self, version: int) -> list[Command]:
        """A learner (re)started from its checkpoint at ``version``: leases in flight and queued
        batches are dropped, as are the consumed groups of later versions; every active worker
        loads the checkpoint's policy; leasing restarts at step ``version``, so the redone
        steps see the prompt groups the lost ones saw."""
        self.in_flight.clear()
        self.backlog.clear()
        self.unqueued.clear()
        self.held.clear()
        self.next_step = version
        self.consumed = {v: g for v, g in self.consumed.items() if v <= version}
        self.version, self.policy_sent, self.policy_ready = version, True, True
        return [DrainQueue(), *(self._send(w, version) for w in self.active())]

    def consumed_counts(self) -> collections.Counter[int]:
        """How often each prompt group reached an update."""
        return collections.Counter(g for groups in self.consumed.values() for g in groups)

    # --- evaluations --------------------------------------------------------------------------

    def evaluation_started(self) -> None:
        """No worker is stopped until the evaluation ends (it would lose its shard)."""
        self.evaluations_running += 1

    def evaluation_finished(self) -> list[Command]:
        """The workers that retired meanwhile are stopped."""
        self.evaluations_running -= 1
        return self._retire_idle()

    def evaluation_workers(self, version: int, can_send: bool) -> tuple[list[int], list[Command]]:
        """The usable workers that can evaluate ``version``, and the policy sends that bring
        them to it. ``can_send`` False (no weights of ``version`` to send: the initial policy)
        keeps only the workers already on it."""
        workers: list[int] = []
        commands: list[Command] = []
        for worker_id in self.usable():
            if self.workers[worker_id].version != version:
                if not can_send:
                    continue
                commands.append(self._send(worker_id, version))
            workers.append(worker_id)
        return workers, commands

    # --- failure ------------------------------------------------------------------------------

    def fail(self, source: Literal["learner", "rollout", "evaluation"], reason: str) -> None:
        """A part of the job stopped it; the latest report is kept (a learner that fails after
        the rollout did says what it saved)."""
        self.failure = Failure(source, reason)

    # --- helpers ------------------------------------------------------------------------------

    def _send(self, worker_id: int, version: int) -> SendPolicy:
        self.workers[worker_id].version = version
        return SendPolicy(worker_id, version)

    def _bring_up_to_date(self, worker_id: int) -> list[Command]:
        """The send that brings a worker to the newest policy; none before any was published
        (a restarted instance is on the initial policy already)."""
        if self.workers[worker_id].version == self.version:
            return []
        if not self.policy_sent:
            self.workers[worker_id].version = self.version
            return []
        return [self._send(worker_id, self.version)]

    def _remove(self, worker_id: int) -> StopWorker:
        del self.workers[worker_id]
        return StopWorker(worker_id)

    def _enqueue_in_order(self) -> list[Command]:
        """Enqueue the held batches whose earlier leases are all enqueued."""
        commands: list[Command] = []
        while self.unqueued and self.unqueued[0] in self.held:
            commands.append(Enqueue(self.held.pop(self.unqueued.popleft())))
        return commands

    def _retire_idle(self) -> list[Command]:
        """Stop the retiring workers that hold no lease, unless an evaluation runs."""
        if self.evaluations_running:
            return []
        busy = self.busy_workers()
        leaving = [w for w, s in self.workers.items() if s.retiring and w not in busy]
        return [self._remove(w) for w in leaving]
