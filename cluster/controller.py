"""The job's controller: the driver-facing API of one training job.

Every scheduling decision (which lease goes where, which worker gets which policy, retirement,
rewinds, evaluation workers, failures) is ``job_state.JobState``'s: the controller turns what
happens on Ray into its events and executes the commands it returns on the rollout pool
(``rollout_pool.RolloutPool``) and the queue. Besides, it starts held-out evaluations
(``evaluation.Evaluator``) and writes the metrics (``metrics_log.MetricsLog``).

It runs as one named Ray actor (``treegrpo-controller-NAME`` in the ``treegrpo`` namespace) with
several threads: ``run`` (the lease loop) occupies one, while the learner's ``publish`` calls,
the driver's ``progress`` calls, ``scale`` requests and background evaluations use the others;
``lock`` guards the state. Every prompt group reaches the learner once (``groups/consumed`` and
``groups/duplicates`` in the summary count it).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.exceptions import OutOfMemoryError, RayActorError
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
from treegrpo_ray.learners.loop import LearnerPlace

EVALS_FILE = "evaluations.json"  # before/after held-out EM, kept for a resumed run's summary
BUDGET_TOTALS = (
    "budget/generated_tokens",
    "budget/tool_calls",
    "budget/prefill_tokens",
    "budget/cached_tokens",
)
PLACEMENT_TIMEOUT_S = 120  # a new rollout worker that cannot be placed by then is given up
POLL_S = 0.2  # the lease loop's longest wait before it looks at stop / pause / scale requests
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
        self.heldout = task.heldout_samples()
        self.queue = TreeQueue(cfg.cluster.queue_size)
        self.search = None  # the retriever actor's client (search_qa): one index per job
        if cfg.task.name == "search_qa":
            name, cpus = retriever_actor_name(cfg.name), cfg.cluster.retriever_cpus
            self.search = start_retriever(cfg.task.search_qa, name, num_cpus=cpus)
        self.pool = RolloutPool(cfg, model_path, self.search)
        self.lock = threading.Condition()
        self.state = JobState(
            leases_of_step(cfg, task.train_samples()),
            cfg.train.steps,
            cfg.train.max_policy_lag,
            cfg.cluster.rollout_max_restarts,
            resume_from,
        )
        self.weights: ray.ObjectRef | None = None  # the newest policy, for workers behind it
        self.receipts: dict[ray.ObjectRef, int] = {}  # receipt of a lease in flight -> ticket
        self.batches: dict[int, ray.ObjectRef] = {}  # ticket -> the lease's tree batch
        self.outbox: list[ray.ObjectRef] = []  # batches to enqueue, outside the lock
        with self.lock:
            self._execute(self.state.add_workers(cfg.cluster.rollout_workers))
        self.learners: dict[int, LearnerPlace] = {}
        self.learner_restarts = 0
        self.evaluator = Evaluator(
            self.heldout,
            eval_seed(cfg.train.seed),
            self._workers_on,
            self.lock,
            self._workers_kept,
        )
        self.started = time.perf_counter()
        self.interval_start = self.started
        self.running = self.paused = self.parked = self.stopped = False
        self.log = MetricsLog(cfg.run_dir, resume_after=resume_from)
        self.evals_file = cfg.run_dir / EVALS_FILE
        self.evals: dict[str, float] = (
            {} if resume_from is None else json.loads(self.evals_file.read_text())
        )

    def get_queue(self) -> TreeQueue:
        return self.queue

    def worker_versions(self) -> list[int]:
        return ray.get([h.policy_version.remote() for h in self.pool.handles()])

    # --- the lease loop -----------------------------------------------------------------------

    def run(self, evaluate_first: bool = False) -> None:
        """Issue leases to idle workers and enqueue finished tree batches until ``stop``: the
        driver stops it once the learner group has finished, since a learner restarted after
        the last version still needs its steps redone.

        ``evaluate_first``: a new run's "before" held-out evaluation runs here, ahead of the
        first lease, so that it overlaps the learner group's start-up."""
        with self.lock:
            self.running = True
        try:
            if evaluate_first:
                snapshot = Snapshot(self.state.version, None)
                self._remember("before", self.evaluator.measure(snapshot, self._final()))
            while self._wait_while_paused():
                with self.lock:
                    self._check_probes()
                    self._execute(self.state.next_leases())
                self._collect(self._ready_receipts())
        except Exception as err:
            self.abort(f"rollout failed: {err}", "rollout")
            with contextlib.suppress(Full):  # no room: the learner is not consuming anyway
                self.queue.put_error(traceback.format_exc(limit=5), timeout=PUT_TIMEOUT_S)
            raise
        finally:
            with self.lock:
                self.running = False
                self.lock.notify_all()

    def _wait_while_paused(self) -> bool:
        """Park while ``restore`` rewinds the job; False once the loop should end."""
        with self.lock:
            if self.paused:
                self.parked = True
                self.lock.notify_all()
                self.lock.wait_for(lambda: not self.paused or self.stopped)
                self.parked = False
            return not self.stopped

    def _execute(self, commands: list[Command], weights: ray.ObjectRef | None = None):
        """Carry out the job state's commands on Ray (the caller holds the lock); returns the
        refs of the policy sends. ``weights``: what they send (default: the newest policy)."""
        sends = []
        for command in commands:
            match command:
                case StartWorker(worker_id):
                    self.pool.start(worker_id)
                case StopWorker(worker_id):
                    self.pool.stop(worker_id)
                case SendPolicy(worker_id, version):
                    sent = weights if weights is not None else self.weights
                    assert sent is not None, "the job state sends no policy before one exists"
                    sends.append(self.pool.sync(worker_id, version, sent))
                case Probe(worker_id):
                    self.pool.probe(worker_id)
                case StartLease(ticket, worker_id, lease):
                    handle = self.pool.workers[worker_id].handle
                    receipt, trees = handle.expand_leased.options(num_returns=2).remote(lease)
                    self.receipts[receipt], self.batches[ticket] = ticket, trees
                case Enqueue(ticket):
                    self.outbox.append(self.batches.pop(ticket))
                case DrainQueue():
                    self.queue.drain()
                    self.receipts.clear()
                    self.batches.clear()
                    self.outbox.clear()
        if commands:
            self.lock.notify_all()
        return sends

    def _check_probes(self) -> None:
        """Workers whose probe answered take leases again; a dead one leaves the pool."""
        for worker_id, error in self.pool.answered_probes():
            if error is None:
                self.state.probe_answered(worker_id)
            else:
                self._execute(self.state.worker_lost(worker_id, worker_death(worker_id, error)))

    def _ready_receipts(self) -> list[ray.ObjectRef]:
        with self.lock:
            pending = list(self.receipts)
            if not pending:
                self.lock.wait(POLL_S)
                return []
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        return ready

    def _collect(self, receipts: list[ray.ObjectRef]) -> None:
        """Enqueue the batches of finished leases; put back the leases of dead workers."""
        for ref in receipts:
            receipt: LeaseReceipt | RayActorError | OutOfMemoryError
            try:
                receipt = ray.get(ref)
            except (RayActorError, OutOfMemoryError) as err:  # the worker died (OOM: Ray killed it)
                receipt = err
            with self.lock:
                ticket = self.receipts.pop(ref, None)
                if ticket is None:  # a rewind dropped the lease
                    continue
                if isinstance(receipt, LeaseReceipt):
                    self._execute(self.state.lease_done(ticket, receipt))
                else:
                    death = worker_death(self.state.in_flight[ticket].worker_id, receipt)
                    self._execute(self.state.lease_lost(ticket, death))
                    self.batches.pop(ticket, None)
                batches, self.outbox = self.outbox, []
            for trees in batches:
                self._enqueue(trees)

    def _enqueue(self, trees: ray.ObjectRef) -> None:
        """Put a batch in the queue, waiting while it is full (backpressure)."""
        while not (self.stopped or self.paused):
            try:
                self.queue.put(trees, timeout=POLL_S)
                return
            except Full:
                continue

    # --- policy versions and evaluation -------------------------------------------------------

    def register_learner(self, rank: int, place: LearnerPlace) -> bool:
        """A learner worker says where it runs; True when that rank has started before in this
        job (Ray Train restarted the group: the job must be rewound)."""
        with self.lock:
            restarted = rank in self.learners
            self.learners[rank] = place
            self.learner_restarts += int(restarted and rank == 0)
            return restarted

    def publish(
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
        measurements = self._measurements_due(version)
        with self.lock:
            self.weights = weights[0]
            self.state.published(version, groups)
            metrics.update(self._pipeline_metrics())
            metrics["timing/elapsed_s"] = time.perf_counter() - self.started
            self.log.add(version, metrics, ready=not measurements)
            self.lock.notify_all()
        if measurements:
            threading.Thread(
                target=self._evaluate_in_background,
                args=(Snapshot(version, weights[0]), measurements, metrics),
                name=f"evaluate-{version}",
                daemon=True,
            ).start()

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

    def _evaluate_in_background(
        self, snapshot: Snapshot, measurements: list[Measurement], record: dict[str, Any]
    ) -> None:
        """Measure ``snapshot`` and complete its held ``record`` (unless a rewind dropped it or
        the job stopped meanwhile); a failed evaluation stops the run."""
        started = time.perf_counter()
        try:
            measured = self.evaluator.measure(snapshot, measurements)
        except Exception as err:
            self.abort(str(err), "evaluation")
            return
        with self.lock:
            if self.stopped:
                return
            if snapshot.version == self.cfg.train.steps:
                self._remember("after", measured)
            extra = {**measured, "timing/eval_s": time.perf_counter() - started}
            self.log.complete(snapshot.version, record, extra)
            self.lock.notify_all()

    def _remember(self, when: str, measured: dict[str, float]) -> None:
        """Keep the before / after evaluation for the summary (``evaluations.json``)."""
        self.evals.update({f"{when}/{m.key}": measured[m.key] for m in self._final()})
        self.evals_file.write_text(json.dumps(self.evals, indent=2))

    def _pipeline_metrics(self) -> dict[str, float]:
        """Queue length, rollout idle share since the last version, the workers' KV caches."""
        now = time.perf_counter()
        workers, counters = len(self.state.active()), self.state.counters
        capacity = max(workers * (now - self.interval_start), 1e-9)
        caches = counters.worker_cache.values()
        busy, counters.busy_s = counters.busy_s, 0.0
        metrics = {
            "queue/size": float(self.queue.size()),
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

    def restore(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """A learner (re)started from its checkpoint at ``version``: rewind the job to it.

        Leases in flight and queued batches are dropped, as are the records and consumed groups
        of later versions; every worker loads the checkpoint's policy; leasing restarts at step
        ``version``, so the redone steps see the prompt groups the lost ones saw."""
        with self.lock:
            self.paused = True
            self.lock.wait_for(lambda: self.parked or not self.running or self.stopped)
            self.log.rewind(version)
            self.weights = weights[0]
            refs = self._execute(self.state.restored(version))
        ray.get(refs)
        with self.lock:
            self.paused = False
            self.lock.notify_all()

    @contextlib.contextmanager
    def _workers_kept(self) -> Iterator[None]:
        """No worker is stopped by a scale-down inside this block (an evaluation would lose the
        shard it gave that worker); the ones that left meanwhile are stopped at its end."""
        with self.lock:
            self.state.evaluation_started()
        try:
            yield
        finally:
            with self.lock:
                self._execute(self.state.evaluation_finished())

    def _workers_on(self, snapshot: Snapshot) -> list[Any]:
        """Handles of the usable workers, each sent ``snapshot`` first if it holds another
        version (the caller holds the lock). Without weights only those already on it."""
        can_send = snapshot.weights is not None
        workers, sends = self.state.evaluation_workers(snapshot.version, can_send)
        self._execute(sends, snapshot.weights)
        return [self.pool.workers[w].handle for w in workers]

    # --- scaling ------------------------------------------------------------------------------

    def scale(self, rollout_workers: int) -> ScaleResult:
        """Grow or shrink the rollout pool to ``rollout_workers`` without touching the learners.

        New workers load the newest policy and take a lease once they answer; the lock is not
        held while their placement groups are reserved, so leases and publishing go on. A
        removed worker finishes the lease it holds (its batch is enqueued) and is then stopped.
        Returns when done."""
        if rollout_workers < 1:
            raise ValueError(f"rollout_workers must be at least 1, got {rollout_workers}")
        with self.lock:
            active = len(self.state.active())
            self.pool.check_room(active, rollout_workers - active)
            started = self.state.add_workers(rollout_workers - active, probe=True)
            self._execute(started)
            added = [c.worker_id for c in started if isinstance(c, StartWorker)]
            groups = [self.pool.workers[w].group for w in added]
        unplaced = wait_for_placement(groups, PLACEMENT_TIMEOUT_S)
        with self.lock:
            if unplaced:
                self._execute(self.state.placement_failed(added))
                raise self.pool.placement_error(unplaced, PLACEMENT_TIMEOUT_S)
            leaving = self.state.active()[rollout_workers:]
            self._execute(self.state.shrink_to(rollout_workers))
            self.lock.wait_for(
                lambda: self.stopped or not any(w in self.state.workers for w in leaving)
            )
            version = self.state.version
            handles = [self.pool.workers[w].handle for w in added]
        added_versions = ray.get([h.policy_version.remote() for h in handles])
        return ScaleResult(len(self.state.active()), version, added_versions)

    # --- for the driver -----------------------------------------------------------------------

    def wait_records(self, after_step: int, timeout: float) -> list[dict[str, Any]]:
        """Step records of steps after ``after_step``; waits up to ``timeout`` s for one."""
        with self.lock:
            self.lock.wait_for(
                lambda: self.stopped or any(r["step"] > after_step for r in self.log.records),
                timeout,
            )
            return [r for r in self.log.records if r["step"] > after_step]

    def summary(self) -> dict[str, Any]:
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
            "rollout/worker_versions": self.worker_versions(),
            "placement": self.placement(),
        }

    def placement(self) -> dict[str, list[str]]:
        """Node ids of the rollout workers and of the learner ranks (in rank order)."""
        node_ids = ray.get(
            [
                h.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                for h in self.pool.handles()
            ]
        )
        learners = [self.learners[rank].node_id for rank in sorted(self.learners)]
        return {"rollout": node_ids, "learner": learners}

    def learner_processes(self) -> dict[int, LearnerPlace]:
        """Learner ranks: node id and pid (``register_learner``)."""
        return dict(self.learners)

    def workers_with_lease(self, timeout: float) -> dict[int, Any]:
        """Handles of the rollout workers running a lease, by worker id; waits up to
        ``timeout`` s for one (observability, and fault tests kill one mid-step)."""
        with self.lock:
            self.lock.wait_for(lambda: self.state.in_flight or self.stopped, timeout)
            busy = self.state.busy_workers()
            return {w: self.pool.workers[w].handle for w in busy if w in self.pool.workers}

    def progress(self, after_step: int, timeout: float) -> Progress:
        """The records of steps after ``after_step`` (waiting up to ``timeout`` s for one), with
        the evaluations still pending and the failure, read together."""
        records = self.wait_records(after_step, timeout)
        with self.lock:
            return Progress(records, bool(self.log.pending), self.state.failure)

    def abort(
        self, reason: str, source: Literal["learner", "rollout", "evaluation"] = "learner"
    ) -> None:
        """A part of the job stopped the run (``reason`` says why and what it saved; a report of
        Ray's memory monitor in it is cut to one line)."""
        with self.lock:
            self.state.fail(source, short_failure(reason))
        self.stop()

    def failed(self) -> Failure | None:
        return self.state.failure

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify_all()
            self.log.close()

    def shutdown(self) -> None:
        """Stop the loop and the rollout workers."""
        self.stop()
        self.pool.shutdown()
