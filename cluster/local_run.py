"""The training loop of ``treegrpo train`` without Ray, for benchmarks that run many short trainings.

One ``RolloutWorker`` and one ``Learner`` in this process run the schedule of a synchronous
one-worker job (``max_policy_lag`` 0) through the job's own step (``learners/loop.py``'s
``learner_step``, this run being its tree source and policy sink): the same leases and seeds,
the same updates, the same held-out evaluations, so a step's record matches the Ray job's (tests
check it). What it leaves out is what a job adds around that loop: Ray start-up (~35 s a run on
2 cores), the queue, checkpoints, the run directory.
"""

from __future__ import annotations

import queue
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import eval_seed, leases_of_step, load_task
from treegrpo_ray.config import JobConfig
from treegrpo_ray.learners.intake import Intake, pull_batch
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.learners.loop import learner_step
from treegrpo_ray.tree import Tree


class LocalRun:
    """A training run stepped by the caller: ``step()`` is one update, ``evaluate()`` a
    held-out evaluation of the current policy. ``train_seconds`` counts rollout + update time
    only (not evaluations), for wall-time matching. With ``save_trees_to`` the updates that
    ``train.save_trees_every`` names keep their trees there, as a job's run directory does
    (``RUN/trees/step-NNNNNN.parquet``: ``treegrpo trees`` and ``treegrpo bench profile`` read
    them)."""

    def __init__(self, cfg: JobConfig, model_path: str, save_trees_to: Path | None = None):
        if cfg.train.max_policy_lag:
            raise ValueError("LocalRun is synchronous: set train.max_policy_lag=0")
        torch.set_num_threads(cfg.cluster.torch_threads)
        self.cfg = cfg
        task = load_task(cfg.task)
        self.train_samples, self.heldout = task.train_samples(), task.heldout_samples()
        self.leases_of_step = leases_of_step(cfg, self.train_samples)
        self.worker = RolloutWorker.from_config(cfg, model_path)
        self.learner = Learner.from_config(cfg, model_path)
        self.train_seconds = 0.0
        self.save_trees_to = save_trees_to

    @property
    def version(self) -> int:
        return self.learner.version

    def step(self) -> dict[str, float]:
        """Expand this step's leases, update the policy once, send it to the worker; returns the
        step's metrics (``tree/``, ``budget/``, ``rollout/``, ``learner/``, ``timing/``)."""
        started = time.perf_counter()
        metrics = learner_step(self.learner, self, self, self.cfg.train, self.save_trees_to)
        saving = metrics.get("timing/save_trees_s", 0.0)
        self.train_seconds += time.perf_counter() - started - saving
        return metrics

    def next_batch(self, version: int) -> Intake:
        """The ``TreeSource`` of this run: its worker expands the step's leases in turn."""
        train = self.cfg.train
        batches: queue.Queue[Any] = queue.Queue()
        for lease in self.leases_of_step(version):
            batches.put(self.worker.expand(lease))
        return pull_batch(batches, train.prompts_per_step, version, 0)

    def publish(self, learner: Learner, trees: list[Tree], metrics: dict[str, float]) -> None:
        """The ``PolicySink`` of this run: the new weights go to its worker."""
        self.worker.load_weights(learner.version, learner.engine_state(self.cfg.engine))

    def evaluate(self, questions: int, temperature: float, repeat: int = 0) -> float:
        """Held-out success rate over the first ``questions`` questions, one chain each;
        ``repeat`` > 0 draws another set of samples (the job's evaluation is ``repeat`` 0)."""
        samples = self.heldout[:questions]
        seed = eval_seed(self.cfg.train.seed) + repeat
        return statistics.fmean(self.worker.evaluate(samples, temperature, seed, self.version))
