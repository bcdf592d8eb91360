"""The job's controller: starts the rollout pool and the queue, leases prompt groups, tracks and
publishes policy versions, runs held-out evaluations, writes the metrics, scales the pool.

It runs as one named Ray actor (``treegrpo-controller-NAME`` in the ``treegrpo`` namespace) with
several threads: ``run`` (the lease loop) occupies one, while the learner's ``publish`` calls,
the driver's ``wait_records`` polls, ``scale`` requests and background evaluations use the others.

Leases: each step's prompt groups are cut into leases of ``prompts_per_step / rollout_workers``
groups; a lease's groups and seed depend only on the step and the run's seed, so any worker can
run it. The controller calls ``worker.expand_leased.remote(lease)`` itself: it owns every tree
batch, and enqueues one only when its receipt (a small separate object) says the lease succeeded.
A lease whose worker died goes back to the front of the backlog; Ray restarts the worker, which
gets the current policy before its next lease. Every prompt group thus reaches the learner once
(``groups/consumed`` and ``groups/duplicates`` in the summary count it).

Streaming: the leases of step ``s`` are issued once the learner's version is at least
``s - max_policy_lag``; a new version is sent to each worker before its next lease, so with a
lag of 1 or more the workers keep generating while the learner trains.
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
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.queue import Full
from torch.utils.tensorboard import SummaryWriter

from treegrpo_ray.actors.schedule import (
    Lease,
    LeaseReceipt,
    eval_seed,
    load_task,
    step_leases,
    training_order,
)
from treegrpo_ray.actors.tree_queue import TreeQueue
from treegrpo_ray.cluster.evaluation import Evaluator, Measurement, Snapshot
from treegrpo_ray.cluster.retriever import retriever_actor_name, start_retriever
from treegrpo_ray.cluster.rollout_pool import RolloutPool, wait_for_placement
from treegrpo_ray.config import JobConfig

NAMESPACE = "treegrpo"
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


def controller_name(run_name: str) -> str:
    """The named actor of run ``run_name`` (in namespace ``NAMESPACE``)."""
    return f"treegrpo-controller-{run_name}"


class MetricsLog:
    """``metrics.jsonl`` plus a TensorBoard log in the run directory.

    ``rewind(step)`` (a resumed run, a restarted learner) drops the records of later steps, which
    are about to be redone, from both; ``records`` holds the ones kept. A record can be held back
    (``add(..., ready=False)``) until its evaluation ``complete``s it; the records after it wait
    with it, so the files stay in step order."""

    def __init__(self, run_dir: Path, resume_after: int | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self.pending: dict[int, tuple[dict[str, Any], bool]] = {}  # step -> (record, ready)
        self.tensorboard: SummaryWriter | None = None
        self.jsonl = None
        if resume_after is None:
            self._open([], None)
        else:
            self.rewind(resume_after)

    def rewind(self, step: int) -> None:
        self.close()
        self.pending = {s: entry for s, entry in self.pending.items() if s <= step}
        self._open(_records_upto(self.path, step), step + 1)

    def add(self, step: int, record: dict[str, Any], ready: bool = True) -> None:
        """Write ``record`` once it and every earlier pending one are ready."""
        self.pending[step] = (record, ready)
        self._flush()

    def complete(self, step: int, extra: dict[str, Any]) -> None:
        """A held record's evaluation finished: add ``extra`` to it and write what is ready.
        Nothing happens if a rewind dropped the step meanwhile."""
        if step in self.pending:
            record, _ = self.pending[step]
            self.pending[step] = ({**record, **extra}, True)
            self._flush()

    def _flush(self) -> None:
        while self.pending:
            step = min(self.pending)
            record, ready = self.pending[step]
            if not ready:
                return
            del self.pending[step]
            self.write(step, record)

    def _open(self, records: list[dict[str, Any]], purge_step: int | None) -> None:
        self.records[:] = records
        self.path.write_text("".join(json.dumps(r) + "\n" for r in records))
        self.jsonl = self.path.open("a")
        self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.records.append({"step": step, **record})
        self.jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)):
                self.tensorboard.add_scalar(key, value, step)
        self.tensorboard.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.tensorboard.close()
            self.jsonl = None


def _records_upto(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The step records in ``path`` up to and including ``last_step``."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= last_step]


@dataclass
class InFlight:
    """A lease being expanded: which worker runs it and the ref of its tree batch."""

    lease: Lease
    worker_id: int
    trees: ray.ObjectRef


class Controller:
    """Orchestrates one training job (see module docstring).

    ``resume_from``: the policy version of the learner checkpoint a resumed run continues from
    (None for a new run). The workers start from ``model_path`` and no lease is issued until the
    learner has sent the restored policy (``restore``)."""

    def __init__(self, cfg: JobConfig, model_path: str, resume_from: int | None = None):
        self.cfg = cfg
        task = load_task(cfg.task)
        self.train_samples = task.train_samples()
        self.heldout = task.heldout_samples()
        self.order = training_order(len(self.train_samples), cfg.train.seed)
        self.queue = TreeQueue(cfg.cluster.queue_size)
        self.search = None  # the retriever actor's client (search_qa): one index per job
        if cfg.task.name == "search_qa":
            name, cpus = retriever_actor_name(cfg.name), cfg.cluster.retriever_cpus
            self.search = start_retriever(cfg.task.search_qa, name, num_cpus=cpus)
        self.pool = RolloutPool(cfg, model_path, self.search)
        for _ in range(cfg.cluster.rollout_workers):
            self.pool.add(0, None)
        self.lock = threading.Condition()
        self.next_step = resume_from or 0
        self.version = self.next_step
        self.weights: ray.ObjectRef | None = None  # the newest policy, for workers behind it
        self.policy_ready = resume_from is None
        self.backlog: collections.deque[Lease] = collections.deque()
        self.in_flight: dict[ray.ObjectRef, InFlight] = {}
        self.consumed: dict[int, list[int]] = {}  # policy version -> groups its update used
        self.learners: dict[int, dict[str, Any]] = {}
        self.learner_restarts = 0
        self.worker_cache: dict[int, dict[str, float]] = {}
        self.evaluations_running = 0  # a scaled-down worker is only stopped when this is 0
        self.evaluator = Evaluator(
            self.heldout, eval_seed(cfg.train.seed), self.pool, self.lock, self._workers_kept
        )
        self.rewinds = 0  # an evaluation started before a rewind is dropped
        self.started = time.perf_counter()
        self.busy_s, self.interval_start = 0.0, self.started
        self.running = self.paused = self.parked = self.stopped = False
        self.failure: str | None = None
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
                    self._plan_steps()
                    self._issue()
                self._collect(self._ready_receipts())
        except Exception as err:
            self.abort(f"rollout failed: {err}")
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

    def _plan_steps(self) -> None:
        """Queue the leases of every step the staleness bound allows now."""
        train = self.cfg.train
        while (
            self.policy_ready
            and self.next_step < train.steps
            and self.version >= self.next_step - train.max_policy_lag
        ):
            self.backlog.extend(self._leases(self.next_step))
            self.next_step += 1

    def _leases(self, step: int) -> list[Lease]:
        """The leases of ``step``: a function of the step and the run's seed only."""
        train = self.cfg.train
        return step_leases(
            self.train_samples,
            self.order,
            step,
            train.prompts_per_step,
            self.cfg.lease_size(),
            train.seed,
        )

    def _issue(self) -> None:
        """Give the next leases to workers without one, each on the newest policy."""
        self.pool.check_probes()
        busy = {item.worker_id for item in self.in_flight.values()}
        for worker_id in self.pool.usable():
            if not self.backlog:
                return
            if worker_id in busy:
                continue
            self._bring_up_to_date(worker_id)
            lease = self.backlog.popleft()
            handle = self.pool.workers[worker_id].handle
            receipt, trees = handle.expand_leased.options(num_returns=2).remote(lease)
            self.in_flight[receipt] = InFlight(lease, worker_id, trees)
            self.lock.notify_all()

    def _bring_up_to_date(self, worker_id: int) -> None:
        worker = self.pool.workers[worker_id]
        if worker.version == self.version:
            return
        if self.weights is None:  # nothing published yet: every instance starts on it
            worker.version = self.version
        else:
            self.pool.sync(worker_id, self.version, self.weights)

    def _ready_receipts(self) -> list[ray.ObjectRef]:
        with self.lock:
            pending = list(self.in_flight)
            if not pending:
                self.lock.wait(POLL_S)
                return []
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        return ready

    def _collect(self, receipts: list[ray.ObjectRef]) -> None:
        """Enqueue the batches of finished leases; put back the leases of dead workers."""
        for ref in receipts:
            failure: RayActorError | None = None
            try:
                receipt: LeaseReceipt = ray.get(ref)
            except RayActorError as err:
                failure = err
            with self.lock:
                item = self.in_flight.pop(ref, None)
                if item is None:  # dropped by a rewind
                    continue
                if failure is not None:
                    self.backlog.appendleft(item.lease)
                    self.pool.lost_lease(item.worker_id, failure)
                else:
                    self.busy_s += receipt.info.rollout_seconds
                    self.worker_cache[item.worker_id] = receipt.cache
                    self._retire_if_asked(item.worker_id)
            if failure is None:
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

    def register_learner(self, rank: int, info: dict[str, Any]) -> bool:
        """A learner worker says where it runs (node id, pid); True when that rank has started
        before in this job (Ray Train restarted the group: the job must be rewound)."""
        with self.lock:
            restarted = rank in self.learners
            self.learners[rank] = info
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
            rewinds = self.rewinds
            self.lock.notify_all()
        if measurements:
            threading.Thread(
                target=self._evaluate_in_background,
                args=(Snapshot(version, weights[0]), measurements, rewinds),
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
        self, snapshot: Snapshot, measurements: list[Measurement], rewinds: int
    ) -> None:
        """Measure ``snapshot`` and complete its held record (dropped if the job was rewound
        or stopped meanwhile); a failed evaluation stops the run."""
        started = time.perf_counter()
        try:
            measured = self.evaluator.measure(snapshot, measurements)
        except Exception as err:
            self.abort(str(err))
            return
        with self.lock:
            if self.stopped or self.rewinds != rewinds:
                return
            if snapshot.version == self.cfg.train.steps:
                self._remember("after", measured)
            self.log.complete(
                snapshot.version, {**measured, "timing/eval_s": time.perf_counter() - started}
            )
            self.lock.notify_all()

    def _remember(self, when: str, measured: dict[str, float]) -> None:
        """Keep the before / after evaluation for the summary (``evaluations.json``)."""
        self.evals.update({f"{when}/{m.key}": measured[m.key] for m in self._final()})
        self.evals_file.write_text(json.dumps(self.evals, indent=2))

    def evaluations_pending(self) -> bool:
        """Whether a step's record still waits for its evaluation."""
        with self.lock:
            return bool(self.log.pending)

    def _pipeline_metrics(self) -> dict[str, float]:
        """Queue length, rollout idle share since the last version, the workers' KV caches."""
        now = time.perf_counter()
        capacity = max(len(self.pool.active()) * (now - self.interval_start), 1e-9)
        metrics = {
            "queue/size": float(self.queue.size()),
            "rollout/idle_frac": max(0.0, 1.0 - self.busy_s / capacity),
            "rollout/workers": float(len(self.pool.active())),
            "rollout/worker_failures": float(self.pool.failures),
            "rollout/cache_bytes": sum(c["bytes"] for c in self.worker_cache.values()),
            "rollout/cache_evictions": sum(c["evictions"] for c in self.worker_cache.values()),
        }
        self.busy_s, self.interval_start = 0.0, now
        return metrics

    def restore(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """A learner (re)started from its checkpoint at ``version``: rewind the job to it.

        Leases in flight and queued batches are dropped, as are the records and consumed groups
        of later versions; every worker loads the checkpoint's policy; leasing restarts at step
        ``version``, so the redone steps see the prompt groups the lost ones saw."""
        with self.lock:
            self.paused = True
            self.lock.wait_for(lambda: self.parked or not self.running or self.stopped)
            self.rewinds += 1
            self.in_flight.clear()
            self.backlog.clear()
            self.queue.drain()
            self.consumed = {v: g for v, g in self.consumed.items() if v <= version}
            self.log.rewind(version)
            self.weights, self.version, self.next_step = weights[0], version, version
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
        holds_lease = any(item.worker_id == worker_id for item in self.in_flight.values())
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
        learners = [self.learners[rank]["node_id"] for rank in sorted(self.learners)]
        return {"rollout": node_ids, "learner": learners}

    def learner_processes(self) -> dict[int, dict[str, Any]]:
        """Learner ranks: node id and pid (``register_learner``)."""
        return dict(self.learners)

    def workers_with_lease(self, timeout: float) -> dict[int, Any]:
        """Handles of the rollout workers running a lease, by worker id; waits up to
        ``timeout`` s for one (observability, and fault tests kill one mid-step)."""
        with self.lock:
            self.lock.wait_for(lambda: self.in_flight or self.stopped, timeout)
            busy = {item.worker_id for item in self.in_flight.values()}
            return {w: self.pool.workers[w].handle for w in busy if w in self.pool.workers}

    def abort(self, reason: str) -> None:
        """The learner stopped the run (``reason`` says why and what it saved)."""
        self.failure = reason
        self.stop()

    def failure_reason(self) -> str | None:
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
