"""The job's controller: the driver-facing API of one training job.

It starts the rollout pool and the queue, runs the lease loop (``leasing.LeaseScheduler`` decides
which lease goes where), tracks and publishes policy versions, starts held-out evaluations
(``evaluation.Evaluator``), writes the metrics (``metrics_log.MetricsLog``), scales the pool and
rewinds the job when a learner restarts.

It runs as one named Ray actor (``treegrpo-controller-NAME`` in the ``treegrpo`` namespace) with
several threads: ``run`` (the lease loop) occupies one, while the learner's ``publish`` calls,
the driver's ``wait_records`` polls, ``scale`` requests and background evaluations use the
others; ``lock`` guards the shared state. Every prompt group reaches the learner once
(``groups/consumed`` and ``groups/duplicates`` in the summary count it).
"""

from __future__ import annotations

import collections
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

from treegrpo_ray.actors.schedule import LeaseReceipt, eval_seed, load_task
from treegrpo_ray.actors.tree_queue import TreeQueue
from treegrpo_ray.cluster.evaluation import Evaluator, Measurement, Snapshot
from treegrpo_ray.cluster.leasing import LeaseScheduler
from treegrpo_ray.cluster.memory_kills import short_failure
from treegrpo_ray.cluster.metrics_log import MetricsLog
from treegrpo_ray.cluster.retriever import retriever_actor_name, start_retriever
from treegrpo_ray.cluster.rollout_pool import RolloutPool, wait_for_placement
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
class Failure:
    """Why a job stopped early: the part that stopped it and its one-line reason (what it
    kept, how to go on)."""

    source: Literal["learner", "rollout", "evaluation"]
    reason: str

    def __str__(self) -> str:
        return self.reason


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
        for _ in range(cfg.cluster.rollout_workers):
            self.pool.add(0, None)
        self.lock = threading.Condition()
        self.version = resume_from or 0
        self.leases = LeaseScheduler(cfg, self.pool, task.train_samples(), self.version)
        self.weights: ray.ObjectRef | None = None  # the newest policy, for workers behind it
        self.policy_ready = resume_from is None
        self.consumed: dict[int, list[int]] = {}  # policy version -> groups its update used
        self.learners: dict[int, LearnerPlace] = {}
        self.learner_restarts = 0
        self.evaluations_running = 0  # a scaled-down worker is only stopped when this is 0
        self.evaluator = Evaluator(
            self.heldout, eval_seed(cfg.train.seed), self.pool, self.lock, self._workers_kept
        )
        self.started = time.perf_counter()
        self.interval_start = self.started
        self.running = self.paused = self.parked = self.stopped = False
        self.failure: Failure | None = None
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
                measured = self.evaluator.measure(Snapshot(self.version, None), self._final())
                self._remember("before", measured)
            while self._wait_while_paused():
                with self.lock:
                    if self.policy_ready:
                        self.leases.plan(self.version)
                    if self.leases.issue(self.version, self.weights):
                        self.lock.notify_all()
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

    def _ready_receipts(self) -> list[ray.ObjectRef]:
        with self.lock:
            pending = list(self.leases.in_flight)
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
                item = self.leases.settle(ref, receipt)
                if item is not None:
                    self._retire_if_asked(item.worker_id)
            if item is not None:
                self._enqueue(item.trees)

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
            self.weights, self.version = weights[0], version
            self.consumed[version] = list(groups)
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
        capacity = max(len(self.pool.active()) * (now - self.interval_start), 1e-9)
        caches = self.leases.worker_cache.values()
        metrics = {
            "queue/size": float(self.queue.size()),
            "rollout/idle_frac": max(0.0, 1.0 - self.leases.take_busy_seconds() / capacity),
            "rollout/workers": float(len(self.pool.active())),
            "rollout/worker_failures": float(self.pool.failures),
            "rollout/memory_kills": float(self.pool.memory_kills),
            "rollout/peak_rss_bytes": float(self.leases.peak_rss_bytes),
            "rollout/cache_bytes": sum(c["bytes"] for c in caches),
            "rollout/cache_evictions": sum(c["evictions"] for c in caches),
            "rollout/memory_throttles": sum(c.get("memory_throttles", 0.0) for c in caches),
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
            self.leases.rewind(version)
            self.queue.drain()
            self.consumed = {v: g for v, g in self.consumed.items() if v <= version}
            self.log.rewind(version)
            self.weights, self.version = weights[0], version
            refs = [self.pool.sync(w, version, weights[0]) for w in self.pool.active()]
        ray.get(refs)
        with self.lock:
            self.policy_ready, self.paused = True, False
            self.lock.notify_all()

    @contextlib.contextmanager
    def _workers_kept(self) -> Iterator[None]:
        """No worker is stopped by a scale-down inside this block (an evaluation would lose the
        shard it gave that worker); the ones that left meanwhile are stopped at its end."""
        with self.lock:
            self.evaluations_running += 1
        try:
            yield
        finally:
            with self.lock:
                self.evaluations_running -= 1
                for worker_id in list(self.pool.workers):
                    self._retire_if_asked(worker_id)

    # --- scaling ------------------------------------------------------------------------------

    def scale(self, rollout_workers: int) -> dict[str, Any]:
        """Grow or shrink the rollout pool to ``rollout_workers`` without touching the learners.

        New workers load the newest policy and take a lease once they answer; the lock is not
        held while their placement groups are reserved, so leases and publishing go on. A
        removed worker finishes the lease it holds (its batch is enqueued) and is then stopped.
        Returns when done."""
        if rollout_workers < 1:
            raise ValueError(f"rollout_workers must be at least 1, got {rollout_workers}")
        with self.lock:
            active = self.pool.active()
            self.pool.check_room(rollout_workers - len(active))
            added = [
                self.pool.add(self.version, self.weights, probe=True)
                for _ in range(rollout_workers - len(active))
            ]
            groups = [self.pool.workers[w].group for w in added]
        unplaced = wait_for_placement(groups, PLACEMENT_TIMEOUT_S)
        with self.lock:
            if unplaced:
                for worker_id in added:
                    self.pool.remove(worker_id)
                raise self.pool.placement_error(unplaced, PLACEMENT_TIMEOUT_S)
            leaving = active[rollout_workers:]
            for worker_id in leaving:
                self.pool.workers[worker_id].retiring = True
                self._retire_if_asked(worker_id)
            self.lock.wait_for(
                lambda: self.stopped or not any(w in self.pool.workers for w in leaving)
            )
            version = self.version
            handles = [self.pool.workers[w].handle for w in added]
        return {
            "rollout_workers": len(self.pool.active()),
            "policy_version": version,
            "added_versions": ray.get([h.policy_version.remote() for h in handles]),
        }

    def _retire_if_asked(self, worker_id: int) -> None:
        """Stop a retiring worker once it holds no lease and no evaluation runs (caller holds
        the lock)."""
        worker = self.pool.workers.get(worker_id)
        holds_lease = self.leases.holds_lease(worker_id)
        if (
            worker is not None
            and worker.retiring
            and not holds_lease
            and not self.evaluations_running
        ):
            self.pool.remove(worker_id)
            self.lock.notify_all()

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
        counts = collections.Counter(g for groups in self.consumed.values() for g in groups)
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
            self.lock.wait_for(lambda: self.leases.in_flight or self.stopped, timeout)
            busy = {item.worker_id for item in self.leases.in_flight.values()}
            return {w: self.pool.workers[w].handle for w in busy if w in self.pool.workers}

    def progress(self, after_step: int, timeout: float) -> Progress:
        """The records of steps after ``after_step`` (waiting up to ``timeout`` s for one), with
        the evaluations still pending and the failure, read together."""
        records = self.wait_records(after_step, timeout)
        with self.lock:
            return Progress(records, bool(self.log.pending), self.failure)

    def abort(
        self, reason: str, source: Literal["learner", "rollout", "evaluation"] = "learner"
    ) -> None:
        """A part of the job stopped the run (``reason`` says why and what it saved; a report of
        Ray's memory monitor in it is cut to one line)."""
        self.failure = Failure(source, short_failure(reason))
        self.stop()

    def failed(self) -> Failure | None:
        return self.failure

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify_all()
            self.log.close()

    def shutdown(self) -> None:
        """Stop the loop and the rollout workers."""
        self.stop()
        self.pool.shutdown()
