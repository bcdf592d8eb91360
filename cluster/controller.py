"""The job's controller: starts rollout workers and the queue, leases prompt groups, publishes
policy versions, runs held-out evaluations and writes the metrics.

It runs as one named Ray actor with several threads: ``run`` (the production loop) occupies one,
while the learner's ``publish`` calls and the driver's ``wait_records`` polls use the others.
The controller calls ``worker.expand.remote(lease)`` itself, so it owns every queued tree batch.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import ray
from torch.utils.tensorboard import SummaryWriter

from actors.rollout_worker import Lease, RolloutWorker
from actors.tree_queue import TreeQueue
from cluster.engines import rollout_actor_options
from treegrpo_ray.config import RunConfig
from treegrpo_ray.envs.multihop import MultihopTask

EVALS_FILE = "evaluations.json"  # before/after held-out EM, kept for a resumed run's summary
BUDGET_TOTALS = (
    "budget/generated_tokens",
    "budget/tool_calls",
    "budget/prefill_tokens",
    "budget/cached_tokens",
)


class MetricsLog:
    """``metrics.jsonl`` plus a TensorBoard log in the run directory.

    Resuming after step ``resume_after``, the records of later steps (written before the job
    died, and about to be redone) are dropped from both; ``records`` holds the ones kept."""

    def __init__(self, run_dir: Path, resume_after: int = 0):
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        self.records = _records_upto(path, resume_after) if resume_after else []
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.jsonl = path.open("a")
        purge = resume_after + 1 if resume_after else None
        self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, step: int, record: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            self.tensorboard.add_scalar(key, value, step)
        self.tensorboard.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.tensorboard.close()


def _records_upto(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The step records in ``path`` up to and including ``last_step``."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= last_step]


class Controller:
    """Orchestrates one training job (see module docstring).

    ``start_step`` > 0 resumes a run whose learner checkpoint is at that policy version: the
    workers start from ``model_path`` and produce nothing until the learner has sent the restored
    policy (``restore``); prompt groups are leased from that step on, as the uninterrupted run
    would have (leases are a function of the step and the seed)."""

    def __init__(self, cfg: RunConfig, model_path: str, start_step: int = 0):
        self.cfg = cfg
        self.start_step = start_step
        task = MultihopTask(cfg.task.multihop)
        self.train_samples = task.train_samples()
        self.heldout = task.heldout_samples()
        self.queue = TreeQueue(cfg.cluster.queue_size)
        remote_worker = ray.remote(RolloutWorker).options(**rollout_actor_options(cfg))
        self.workers = [
            remote_worker.remote(
                model_path,
                cfg.task,
                cfg.tree,
                cfg.sampling,
                cfg.engine,
                seed=cfg.train.seed + i,
                torch_threads=cfg.cluster.torch_threads,
            )
            for i in range(cfg.cluster.rollout_workers)
        ]
        self.version = start_step
        self.policy_ready = start_step == 0
        self.changed = threading.Condition()
        self.log = MetricsLog(cfg.run_dir, resume_after=start_step)
        self.records: list[dict[str, Any]] = self.log.records
        self.stopped = False
        self.failure: str | None = None
        self.evals_file = cfg.run_dir / EVALS_FILE
        self.evals: dict[str, float] = json.loads(self.evals_file.read_text()) if start_step else {}

    def get_queue(self) -> TreeQueue:
        return self.queue

    def worker_versions(self) -> list[int]:
        return ray.get([w.policy_version.remote() for w in self.workers])

    # --- production -------------------------------------------------------------------------

    def run(self) -> None:
        """Lease every step's prompt groups to the workers, at most ``max_policy_lag`` versions
        ahead of the learner, and enqueue the resulting tree batches."""
        train = self.cfg.train
        order = list(range(len(self.train_samples)))
        random.Random(train.seed).shuffle(order)
        try:
            for step in range(self.start_step, train.steps):
                with self.changed:
                    self.changed.wait_for(
                        lambda s=step: (
                            self.stopped
                            or (self.policy_ready and self.version >= s - train.max_policy_lag)
                        )
                    )
                if self.stopped:
                    return
                for ref in self._lease_step(step, order):
                    self.queue.put(ref)
        except Exception:
            self.queue.put_error(traceback.format_exc(limit=5))
            raise

    def _lease_step(self, step: int, order: list[int]) -> list[ray.ObjectRef]:
        per_step = self.cfg.train.prompts_per_step
        share = per_step // len(self.workers)
        refs = []
        for w, worker in enumerate(self.workers):
            first = step * per_step + w * share
            groups = tuple(
                (g, self.train_samples[order[g % len(order)]]) for g in range(first, first + share)
            )
            lease_id = step * len(self.workers) + w
            lease = Lease(
                lease_id=lease_id, groups=groups, seed=self.cfg.train.seed * 7919 + lease_id
            )
            refs.append(worker.expand.remote(lease))
        return refs

    # --- policy versions and evaluation ----------------------------------------------------

    def publish(
        self, version: int, weights: list[ray.ObjectRef], metrics: dict[str, float]
    ) -> None:
        """Load policy ``version`` into every worker, evaluate when due, record the step."""
        metrics.update(self._engine_cache_metrics())
        start = time.perf_counter()
        ray.get([w.load_weights.remote(version, weights[0]) for w in self.workers])
        metrics["timing/weight_sync"] = time.perf_counter() - start
        train = self.cfg.train
        if version == train.steps:
            metrics.update(self.final_evaluation("after"))
        elif train.eval_every and version % train.eval_every == 0:
            metrics["eval/greedy_em"] = self.evaluate(train.eval_questions, temperature=0.0)
        with self.changed:
            self.version = version
            self.records.append({"step": version, **metrics})
            self.log.write(version, metrics)
            self.changed.notify_all()

    def restore(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """Load the resumed learner's policy ``version`` into every worker; production starts."""
        ray.get([w.load_weights.remote(version, weights[0]) for w in self.workers])
        with self.changed:
            self.version = version
            self.policy_ready = True
            self.changed.notify_all()

    def _engine_cache_metrics(self) -> dict[str, float]:
        """KV held by the workers' prefix caches now and evictions since start (all workers)."""
        stats = ray.get([w.cache_stats.remote() for w in self.workers])
        return {
            "rollout/cache_bytes": float(sum(s["bytes"] for s in stats)),
            "rollout/cache_evictions": float(sum(s["evictions"] for s in stats)),
        }

    def evaluate(self, questions: int, temperature: float) -> float:
        """Held-out success rate (one chain per question), sharded over the workers."""
        samples = self.heldout[:questions]
        shards = [samples[i :: len(self.workers)] for i in range(len(self.workers))]
        seed = self.cfg.train.seed + 104729
        results = ray.get(
            [
                w.evaluate.remote(s, temperature, seed)
                for w, s in zip(self.workers, shards, strict=True)
            ]
        )
        return statistics.fmean(x for shard in results for x in shard)

    def final_evaluation(self, when: str) -> dict[str, float]:
        """Sampled (at the training temperature) and greedy held-out EM, remembered by ``when``."""
        n = self.cfg.train.final_eval_questions
        result = {
            "eval/sampled_em": self.evaluate(n, self.cfg.sampling.temperature),
            "eval/greedy_em": self.evaluate(n, temperature=0.0),
        }
        self.evals.update({f"{when}/{k}": v for k, v in result.items()})
        self.evals_file.write_text(json.dumps(self.evals, indent=2))
        return result

    # --- for the driver ---------------------------------------------------------------------

    def wait_records(self, after: int, timeout: float) -> list[dict[str, Any]]:
        """Step records newer than step ``after``; waits up to ``timeout`` seconds for one."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.records) > after or self.stopped, timeout)
            return self.records[after:]

    def summary(self) -> dict[str, Any]:
        totals: dict[str, float] = {}
        for record in self.records:
            for key in BUDGET_TOTALS:
                totals[key] = totals.get(key, 0.0) + record.get(key, 0.0)
        return {
            **self.evals,
            **totals,
            "steps": len(self.records),
            "rollout/worker_versions": self.worker_versions(),
        }

    def abort(self, reason: str) -> None:
        """The learner stopped the run (``reason`` says why and what it saved)."""
        self.failure = reason
        self.stop()

    def failure_reason(self) -> str | None:
        return self.failure

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()
        self.log.close()
