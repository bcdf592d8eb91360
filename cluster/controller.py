"""The job's controller: the driver-facing API of one training job.

Every scheduling decision (which lease goes where, which worker gets which policy, retirement,
rewinds, evaluation workers, failures) is ``job_state.JobState``'s; the controller is a thin event
loop around it. It runs as one named asyncio Ray actor (``treegrpo-controller-NAME`` in the
``treegrpo`` namespace): its methods and its tasks all run on the actor's one event loop, so the
state is only touched between two awaits and needs no lock. The events are what the loop awaits
(a lease's receipt, a probe's answer, room in the queue, a placement, an evaluation's shards) and
the calls it gets (the learner's ``publish`` and ``restore``, ``scale``, ``stop``); each becomes
one of the state's events, whose commands are carried out on the rollout pool
(``rollout_pool.RolloutPool``) and the queue without waiting. Held-out evaluations
(``evaluation.Evaluator``) are tasks on the same loop; ``metrics_log.MetricsLog`` writes the
records. Every prompt group reaches the learner once (``groups/consumed`` and
``groups/duplicates`` in the summary count it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.exceptions import ActorUnavailableError, OutOfMemoryError, RayActorError, RayTaskError
from ray.util.queue import Full

from treegrpo_ray.actors.schedule import LeaseReceipt, eval_seed, leases_of_step, load_task
from treegrpo_ray.actors.tree_queue import TreeQueue
from treegrpo_ray.cluster.evaluation import Evaluator, Measurement, Snapshot
from treegrpo_ray.cluster.job_state import (
    Command,
    DrainQueue,
    Enqueue,
    Failure,
    JobState,
    Probe,
    ScaleResult,
    SendPolicy,
    StartLease,
    StartWorker,
    StopWorker,
)
from treegrpo_ray.cluster.memory_kills import short_failure
from treegrpo_ray.cluster.metrics_log import MetricsLog
from treegrpo_ray.cluster.retriever import retriever_actor_name, start_retriever
from treegrpo_ray.cluster.rollout_pool import RolloutPool, wait_for_placement, worker_death
from treegrpo_ray.config import JobConfig
from treegrpo_ray.learners.checkpoint import resume_hint
from treegrpo_ray.learners.loop import LearnerPlace

EVALS_FILE = "evaluations.json"  # before/after held-out EM, kept for a resumed run's summary
BUDGET_TOTALS = (
    "budget/generated_tokens",
    "budget/tool_calls",
    "budget/prefill_tokens",
    "budget/cached_tokens",
)
PLACEMENT_TIMEOUT_S = 120  # a new rollout worker that cannot be placed by then is given up
POLL_S = 0.2  # the longest wait for room in the queue, or between probes of a restarting worker
PUT_TIMEOUT_S = 60  # the longest wait for room in the queue for a failure message


@dataclass(frozen=True)
class Progress:
    """What the driver needs to follow a job, in one call: the step records after the step it
    has shown, whether a record still waits for its evaluation, and the failure if any."""

    records: list[dict[str, Any]]
    evaluations_pending: bool
    failure: Failure | None


class Controller:
    """Orchestrates one training job (see module docstring).

    ``resume_from``: the policy version of the learner checkpoint a resumed run continues from
    (None for a new run). The workers start from ``model_path`` and no lease is issued until the
    learner has sent the restored policy (``restore``)."""

    def __init__(self, cfg: JobConfig, model_path: str, resume_from: int | None = None):
        self.cfg = cfg
        task = load_task(cfg.task)
        self.queue = TreeQueue(cfg.cluster.queue_size)
        self.search = None  # the retriever actor's client (search_qa): one index per job
        if cfg.task.name == "search_qa":
            name, cpus = retriever_actor_name(cfg.name), cfg.cluster.retriever_cpus
            self.search = start_retriever(cfg.task.search_qa, name, num_cpus=cpus)
        self.pool = RolloutPool(cfg, model_path, self.search)
        self.state = JobState(
            leases_of_step(cfg, task.train_samples()),
            cfg.train.steps,
            cfg.train.max_policy_lag,
            cfg.cluster.rollout_max_restarts,
            resume_from,
        )
        self.weights: ray.ObjectRef | None = None  # the newest policy, for workers behind it
        self.batches: dict[int, ray.ObjectRef] = {}  # ticket of a lease in flight -> its batch
        self.outbox: collections.deque[ray.ObjectRef] = collections.deque()  # batches to put
        self.queue_lock = asyncio.Lock()  # one put at a time, and a rewind's drain after it
        self.draining = False  # a rewind drops the queue's batches: no put until it is done
        self.tasks: set[asyncio.Task[None]] = set()  # receipts, probes, puts, evaluations
        self.tick = asyncio.Event()  # set (and replaced) whenever the job changes
        self._execute(self.state.add_workers(cfg.cluster.rollout_workers))
        self.learners: dict[int, LearnerPlace] = {}
        self.learner_restarts = 0
        self.evaluator = Evaluator(
            task.heldout_samples(),
            eval_seed(cfg.train.seed),
            self._workers_on,
            self._workers_kept,
            self._next_change,
        )
        self.started = time.perf_counter()
        self.interval_start = self.started
        self.leasing = self.stopped = False
        self.log = MetricsLog(cfg.run_dir, resume_after=resume_from)
        self.evals_file = cfg.run_dir / EVALS_FILE
        self.evals: dict[str, float] = (
            {} if resume_from is None else json.loads(self.evals_file.read_text())
        )

    def get_queue(self) -> TreeQueue:
        return self.queue

    async def worker_versions(self) -> list[int]:
        return await asyncio.gather(*(h.policy_version.remote() for h in self.pool.handles()))

    # --- the event loop -----------------------------------------------------------------------

    async def run(self, evaluate_first: bool = False) -> None:
        """Start issuing leases to idle workers and return once the job stops: the driver stops
        it once the learner group has finished, since a learner restarted after the last
        version still needs its steps redone.

        ``evaluate_first``: a new run's "before" held-out evaluation runs here, ahead of the
        first lease, so that it overlaps the learner group's start-up."""
        if evaluate_first:
            snapshot = Snapshot(self.state.version, None)
            try:
                self._remember("before", await self.evaluator.measure(snapshot, self._final()))
            except Exception as err:
                await self._rollout_failed(err)
                raise
        self.leasing = True
        self._lease()
        await self._until(lambda: self.stopped)

    def _execute(self, commands: list[Command], weights: ray.ObjectRef | None = None):
        """Carry out the job state's commands on Ray without waiting; returns what the caller
        may await: the policy sends, a rewind's drain of the queue. ``weights``: what the sends
        send (default: the newest policy)."""
        waits: list[Awaitable[Any]] = []
        for command in commands:
            match command:
                case StartWorker(worker_id):
                    self.pool.start(worker_id)
                case StopWorker(worker_id):
                    self.pool.stop(worker_id)
                case SendPolicy(worker_id, version):
                    sent = weights if weights is not None else self.weights
                    assert sent is not None, "the job state sends no policy before one exists"
                    waits.append(self.pool.sync(worker_id, version, sent))
                case Probe(worker_id):
                    self._spawn(self._probe(worker_id))
                case StartLease(ticket, worker_id, lease):
                    handle = self.pool.workers[worker_id].handle
                    receipt, trees = handle.expand_leased.options(num_returns=2).remote(lease)
                    self.batches[ticket] = trees
                    self._spawn(self._receive(ticket, receipt))
                case Enqueue(ticket):
                    self.outbox.append(self.batches.pop(ticket))
                    self._spawn(self._put_outbox())
                case DrainQueue():
                    self.batches.clear()
                    self.outbox.clear()
                    self.draining = True
                    waits.append(self._spawn(self._drain()))
        self._changed()
        return waits

    def _lease(self) -> None:
        """Issue the leases the state allows, unless finished batches wait for room in the
        queue (backpressure) or the job stops."""
        if self.leasing and not (self.outbox or self.stopped):
            self._execute(self.state.next_leases())

    async def _receive(self, ticket: int, receipt_ref: ray.ObjectRef) -> None:
        """Lease ``ticket`` ended: its batch goes to the queue, or, if its worker died, the
        lease goes back to the backlog."""
        receipt: LeaseReceipt | RayActorError | OutOfMemoryError
        try:
            receipt = await receipt_ref
        except (RayActorError, OutOfMemoryError) as err:  # the worker died (OOM: Ray killed it)
            receipt = err
        if self.stopped or ticket not in self.batches:  # or a rewind dropped the lease
            return
        if isinstance(receipt, LeaseReceipt):
            self._execute(self.state.lease_done(ticket, receipt))
        else:
            death = worker_death(self.state.in_flight[ticket].worker_id, receipt)
            del self.batches[ticket]
            self._execute(self.state.lease_lost(ticket, death))
        self._lease()

    async def _probe(self, worker_id: int) -> None:
        """Ask a new or restarted worker until it answers (it takes leases again) or turns out
        dead (it leaves the pool)."""
        while worker_id in self.pool.workers and not self.stopped:
            try:
                await self.pool.workers[worker_id].handle.policy_version.remote()
            except ActorUnavailableError:  # still restarting
                await asyncio.sleep(POLL_S)
                continue
            except RayActorError as err:
                if worker_id in self.pool.workers:  # else stopped meanwhile: no death
                    self._execute(self.state.worker_lost(worker_id, worker_death(worker_id, err)))
            else:
                self.state.probe_answered(worker_id)
                self._changed()
            self._lease()
            return

    async def _put_outbox(self) -> None:
        """Put the finished batches in the queue in order, waiting while it is full; then
        lease again."""
        async with self.queue_lock:
            while self.outbox and not (self.stopped or self.draining):
                trees = self.outbox[0]
                try:
                    await self.queue.put(trees, timeout=POLL_S)
                except Full:
                    continue
                if self.outbox and self.outbox[0] is trees:  # else a rewind dropped it
                    self.outbox.popleft()
        self._lease()

    async def _drain(self) -> None:
        """Drop the queued batches of a rewind, after the put in progress if any."""
        async with self.queue_lock:
            await self.queue.drain()
        self.draining = False
        if self.outbox:  # batches of the redone steps, held back meanwhile
            self._spawn(self._put_outbox())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` as a task on the loop; an error in it stops the run."""
        task = asyncio.get_running_loop().create_task(self._guarded(work))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as err:
            if not self.stopped:  # else the workers are being shut down: nothing to report
                await self._rollout_failed(err)

    async def _rollout_failed(self, err: Exception) -> None:
        """Stop the run, and tell the learners through the queue (a learner waiting for trees
        raises instead of waiting forever)."""
        self.abort(f"rollout failed: {err}", "rollout")
        message = "".join(traceback.format_exception(err, limit=5))
        with contextlib.suppress(Full):  # no room: the learner is not consuming anyway
            await self.queue.put_error(message, timeout=PUT_TIMEOUT_S)

    def _changed(self) -> None:
        """Wake every wait on the job's state (``_until``, ``_next_change``)."""
        self.tick.set()
        self.tick = asyncio.Event()

    async def _next_change(self, timeout: float | None) -> None:
        """Wait for the next change of the job, at most ``timeout`` s."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.tick.wait(), timeout)

    async def _until(self, predicate: Callable[[], Any], timeout: float | None = None) -> bool:
        """Wait until ``predicate()`` holds, at most ``timeout`` s; returns whether it does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            await self._next_change(remaining)
        return True

    # --- policy versions and evaluation -------------------------------------------------------

    def register_learner(self, rank: int, place: LearnerPlace) -> bool:
        """A learner worker says where it runs; True when that rank has started before in this
        job (Ray Train restarted the group: the job must be rewound)."""
        restarted = rank in self.learners
        self.learners[rank] = place
        self.learner_restarts += int(restarted and rank == 0)
        return restarted

    async def publish(
        self,
        version: int,
        weights: list[ray.ObjectRef],
        metrics: dict[str, float],
        groups: list[int],
    ) -> None:
        """Record policy ``version`` (the update consumed ``groups``); workers get it before
        their next lease. When an evaluation is due it runs on the rollout workers in the
        background and the version's record is written once it is done: the learner does not
        wait for it."""
        queued = await self.queue.size()
        measurements = self._measurements_due(version)
        self.weights = weights[0]
        self.state.published(version, groups)
        metrics.update(self._pipeline_metrics(queued))
        metrics["timing/elapsed_s"] = time.perf_counter() - self.started
        self.log.add(version, metrics, ready=not measurements)
        if measurements:
            snapshot = Snapshot(version, weights[0])
            self._spawn(self._evaluate(snapshot, measurements, metrics))
        self._changed()
        self._lease()

    def _measurements_due(self, version: int) -> list[Measurement]:
        train = self.cfg.train
        if version == train.steps:
            return self._final()
        if train.eval_every and version % train.eval_every == 0:
            return [Measurement("eval/greedy_em", train.eval_questions, temperature=0.0)]
        return []

    def _final(self) -> list[Measurement]:
        """The before / after evaluation: sampled at the training temperature, and greedy."""
        n = self.cfg.train.final_eval_questions
        return [
            Measurement("eval/sampled_em", n, self.cfg.sampling.temperature),
            Measurement("eval/greedy_em", n, temperature=0.0),
        ]

    async def _evaluate(
        self, snapshot: Snapshot, measurements: list[Measurement], record: dict[str, Any]
    ) -> None:
        """Measure ``snapshot`` and complete its held ``record`` (unless a rewind dropped it or
        the job stopped meanwhile); a failed evaluation stops the run."""
        started = time.perf_counter()
        try:
            measured = await self.evaluator.measure(snapshot, measurements)
        except Exception as err:  # a worker's error: its message (the traceback is in its log)
            cause = err.cause if isinstance(err, RayTaskError) else err
            self.abort(f"{cause}; {resume_hint(self.cfg.run_dir)}", "evaluation")
            return
        if self.stopped:
            return
        if snapshot.version == self.cfg.train.steps:
            self._remember("after", measured)
        extra = {**measured, "timing/eval_s": time.perf_counter() - started}
        self.log.complete(snapshot.version, record, extra)
        self._changed()

    def _remember(self, when: str, measured: dict[str, float]) -> None:
        """Keep the before / after evaluation for the summary (``evaluations.json``)."""
        self.evals.update({f"{when}/{m.key}": measured[m.key] for m in self._final()})
        self.evals_file.write_text(json.dumps(self.evals, indent=2))

    def _pipeline_metrics(self, queued: int) -> dict[str, float]:
        """Queue length (``queued``), rollout idle share since the last version, the workers'
        KV caches."""
        now = time.perf_counter()
        workers, counters = len(self.state.active()), self.state.counters
        capacity = max(workers * (now - self.interval_start), 1e-9)
        caches = counters.worker_cache.values()
        busy, counters.busy_s = counters.busy_s, 0.0
        metrics = {
            "queue/size": float(queued),
            "rollout/idle_frac": max(0.0, 1.0 - busy / capacity),
            "rollout/workers": float(workers),
            "rollout/worker_failures": float(counters.failures),
            "rollout/memory_kills": float(counters.memory_kills),
            "rollout/peak_rss_bytes": float(counters.peak_rss_bytes),
            "rollout/cache_bytes": float(sum(c.bytes for c in caches)),
            "rollout/cache_evictions": float(sum(c.evictions for c in caches)),
            "rollout/memory_throttles": float(sum(c.memory_throttles for c in caches)),
        }
        self.interval_start = now
        return metrics

    async def restore(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """A learner (re)started from its checkpoint at ``version``: rewind the job to it.

        Leases in flight and queued batches are dropped, as are the records and consumed groups
        of later versions; every worker loads the checkpoint's policy; leasing restarts at step
        ``version``, so the redone steps see the prompt groups the lost ones saw. Returns once
        the queue is drained and the workers hold the policy."""
        self.log.rewind(version)
        self.weights = weights[0]
        await asyncio.gather(*self._execute(self.state.restored(version)))
        self._lease()

    @contextlib.contextmanager
    def _workers_kept(self) -> Iterator[None]:
        """No worker is stopped by a scale-down inside this block (an evaluation would lose the
        shard it gave that worker); the ones that left meanwhile are stopped at its end."""
        self.state.evaluation_started()
        try:
            yield
        finally:
            self._execute(self.state.evaluation_finished())

    def _workers_on(self, snapshot: Snapshot) -> list[Any]:
        """Handles of the usable workers, each sent ``snapshot`` first if it holds another
        version. Without weights only those already on it."""
        can_send = snapshot.weights is not None
        workers, sends = self.state.evaluation_workers(snapshot.version, can_send)
        self._execute(sends, snapshot.weights)
        return [self.pool.workers[w].handle for w in workers]

    # --- scaling ------------------------------------------------------------------------------

    async def scale(self, rollout_workers: int) -> ScaleResult:
        """Grow or shrink the rollout pool to ``rollout_workers`` without touching the learners.

        New workers load the newest policy and take a lease once they answer; leases and
        publishing go on while their placement groups are reserved. A removed worker finishes
        the lease it holds (its batch is enqueued) and is then stopped. Returns when done."""
        if rollout_workers < 1:
            raise ValueError(f"rollout_workers must be at least 1, got {rollout_workers}")
        active = len(self.state.active())
        self.pool.check_room(active, rollout_workers - active)
        started = self.state.add_workers(rollout_workers - active, probe=True)
        added = [c.worker_id for c in started if isinstance(c, StartWorker)]
        self._execute(started)
        groups = [self.pool.workers[w].group for w in added]
        unplaced = await wait_for_placement(groups, PLACEMENT_TIMEOUT_S)
        if unplaced:
            self._execute(self.state.placement_failed(added))
            raise self.pool.placement_error(unplaced, PLACEMENT_TIMEOUT_S)
        leaving = self.state.active()[rollout_workers:]
        self._execute(self.state.shrink_to(rollout_workers))
        await self._until(lambda: self.stopped or not any(w in self.state.workers for w in leaving))
        version = self.state.version
        handles = [self.pool.workers[w].handle for w in added]
        added_versions = await asyncio.gather(*(h.policy_version.remote() for h in handles))
        return ScaleResult(len(self.state.active()), version, list(added_versions))

    # --- for the driver -----------------------------------------------------------------------

    async def wait_records(self, after_step: int, timeout: float) -> list[dict[str, Any]]:
        """Step records of steps after ``after_step``; waits up to ``timeout`` s for one."""
        await self._until(
            lambda: self.stopped or any(r["step"] > after_step for r in self.log.records),
            timeout,
        )
        return [r for r in self.log.records if r["step"] > after_step]

    async def summary(self) -> dict[str, Any]:
        totals: dict[str, float] = {}
        for record in self.log.records:
            for key in BUDGET_TOTALS:
                totals[key] = totals.get(key, 0.0) + record.get(key, 0.0)
        counts = self.state.consumed_counts()
        return {
            **self.evals,
            **totals,
            "steps": len(self.log.records),
            "groups/consumed": len(counts),
            "groups/duplicates": sum(1 for n in counts.values() if n > 1),
            "learner/restarts": self.learner_restarts,
            "rollout/worker_versions": await self.worker_versions(),
            "placement": await self.placement(),
        }

    async def placement(self) -> dict[str, list[str]]:
        """Node ids of the rollout workers and of the learner ranks (in rank order)."""
        node_ids = await asyncio.gather(
            *(
                h.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                for h in self.pool.handles()
            )
        )
        learners = [self.learners[rank].node_id for rank in sorted(self.learners)]
        return {"rollout": list(node_ids), "learner": learners}

    def learner_processes(self) -> dict[int, LearnerPlace]:
        """Learner ranks: node id and pid (``register_learner``)."""
        return dict(self.learners)

    async def workers_with_lease(self, timeout: float) -> dict[int, Any]:
        """Handles of the rollout workers running a lease, by worker id; waits up to
        ``timeout`` s for one (observability, and fault tests kill one mid-step)."""
        await self._until(lambda: self.state.in_flight or self.stopped, timeout)
        busy = self.state.busy_workers()
        return {w: self.pool.workers[w].handle for w in busy if w in self.pool.workers}

    async def evaluations_finished(self) -> None:
        """Return once no evaluation of a published version is pending, or the job stopped: the
        learner that published the versions owns their weights, so it waits for this before it
        exits (else a worker still busy could no longer load the version it is to measure)."""
        await self._until(lambda: not self.log.pending or self.stopped)

    async def progress(self, after_step: int, timeout: float) -> Progress:
        """The records of steps after ``after_step`` (waiting up to ``timeout`` s for one), with
        the evaluations still pending and the failure, read together."""
        records = await self.wait_records(after_step, timeout)
        return Progress(records, bool(self.log.pending), self.state.failure)

    def abort(
        self, reason: str, source: Literal["learner", "rollout", "evaluation"] = "learner"
    ) -> None:
        """A part of the job stopped the run (``reason`` says why and what it saved; a report of
        Ray's memory monitor in it is cut to one line)."""
        self.state.fail(source, short_failure(reason))
        self.stop()

    def failed(self) -> Failure | None:
        return self.state.failure

    def stop(self) -> None:
        self.stopped = True
        self.log.close()
        self._changed()

    def shutdown(self) -> None:
        """Stop the loop and the rollout workers."""
        self.stop()
        self.pool.shutdown()
