"""One training loop for the Ray job and the in-process run.

``learner_step`` is one update: trees from a ``TreeSource``, the PPO update, the trees
``train.save_trees_every`` names kept, the new policy handed to a ``PolicySink``. The Ray Train
worker (``train_loop_per_worker``) reads the tree queue (``QueueSource``) and publishes through
the controller (``ControllerSink``); ``cluster/local_run.py``'s ``LocalRun`` expands its own
leases and loads the new weights into its own rollout worker.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from treegrpo_ray.config import JobConfig, TrainConfig
from treegrpo_ray.errors import TrainingStopped, UserInputError
from treegrpo_ray.learners.checkpoint import (
    CheckpointNotWritten,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from treegrpo_ray.learners.distributed import broadcast_from_first
from treegrpo_ray.learners.intake import Intake, pull_batch
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.metrics import timed
from treegrpo_ray.saved_trees import should_save
from treegrpo_ray.tree import Tree


@dataclass(frozen=True)
class LearnerPlace:
    """Where a learner rank runs (what it tells the controller's ``register_learner``)."""

    node_id: str
    pid: int


class TreeSource(Protocol):
    def next_batch(self, version: int) -> Intake:
        """The trees of the update after ``version`` and what taking them in cost; raises
        ``TrainingStopped`` when none will come."""
        ...


class PolicySink(Protocol):
    def publish(self, learner: Learner, trees: list[Tree], metrics: dict[str, float]) -> None:
        """Hand the learner's new version to whoever generates (``metrics`` is the step's)."""
        ...


def learner_step(
    learner: Learner,
    source: TreeSource,
    sink: PolicySink,
    train: TrainConfig,
    trees_dir: Path | None,
) -> dict[str, float]:
    """One update; returns its metrics. ``trees_dir``: where the updates that
    ``train.save_trees_every`` names keep their trees (None: nowhere)."""
    intake = source.next_batch(learner.version)
    trees, metrics = intake.trees, intake.metrics()
    with timed(metrics, "update"):
        metrics.update(learner.update(trees))
    if trees_dir is not None and should_save(train.save_trees_every, learner.version, train.steps):
        with timed(metrics, "save_trees"):
            learner.save_trees(trees_dir, trees, metrics)
    sink.publish(learner, trees, metrics)
    return metrics


class QueueSource:
    """Rank 0 takes each batch from the tree queue and every rank gets it; a stop rank 0 meets
    is raised on every rank."""

    def __init__(self, queue: Any, train: TrainConfig, first: bool, world_size: int):
        self.queue, self.train, self.first, self.world_size = queue, train, first, world_size

    def next_batch(self, version: int) -> Intake:
        batch: Any = None
        if self.first:
            train = self.train
            try:
                batch = pull_batch(
                    self.queue,
                    train.prompts_per_step,
                    version,
                    train.max_policy_lag,
                    train.queue_timeout_s,
                )
            except TrainingStopped as err:
                batch = err
        if self.world_size > 1:
            batch = broadcast_from_first(batch)
        if isinstance(batch, TrainingStopped):
            raise batch
        return batch


class ControllerSink:
    """Rank 0 publishes each version through the controller (with the share of the cycle the
    learner sat idle) and checkpoints every ``train.checkpoint_every`` updates; other ranks hand
    nothing on."""

    def __init__(self, controller: Any, cfg: JobConfig, first: bool):
        self.controller, self.cfg, self.first = controller, cfg, first
        self.cycle_start, self.publish_s = time.perf_counter(), 0.0

    def publish(self, learner: Learner, trees: list[Tree], metrics: dict[str, float]) -> None:
        import ray

        if not self.first:
            return
        # idle: waiting for trees, and for the previous version's publish call (this cycle runs
        # from that call's start to this one's)
        metrics["timing/publish_wait_s"] = self.publish_s
        idle = metrics["queue/wait_s"] + self.publish_s
        metrics["learner/idle_frac"] = idle / (time.perf_counter() - self.cycle_start)
        self.cycle_start = time.perf_counter()
        weights = ray.put(learner.engine_state(self.cfg.worker_engine()))
        groups = sorted({t.group_id for t in trees})
        ray.get(self.controller.publish.remote(learner.version, [weights], metrics, groups))
        self.publish_s = time.perf_counter() - self.cycle_start
        every = self.cfg.train.checkpoint_every
        if every and learner.version % every == 0:
            checkpoints = self.cfg.run_dir / "checkpoints"
            save_checkpoint(learner.state_dict(), checkpoints, {"step": learner.version})


def _save_last_good(learner: Learner, cfg: Any, err: Exception) -> str:
    """Save the policy and the training state the run stopped with; returns the stop reason."""
    kept = learner.save(cfg.run_dir / "checkpoint-last-good", {"step": learner.version})
    save_checkpoint(learner.state_dict(), cfg.run_dir / "checkpoints", {"step": learner.version})
    return (
        f"{err}; the last good policy is in {kept}; once fixed, continue with "
        f"`treegrpo train --resume {cfg.run_dir} --set KEY=VALUE`"
    )


def train_loop_per_worker(config: dict) -> None:
    """Ray Train worker: pull trees, update, publish each new version through the controller.

    With several workers, rank 0 pulls each batch and broadcasts it; every rank updates on its
    share of the rows (``treegrpo_ray.learners.distributed``); rank 0 publishes and saves (the
    checkpoints, and the trees every ``train.save_trees_every`` updates). When the run
    directory holds a training-state checkpoint (a resumed run, or Ray Train restarting the group
    after a worker died), every rank restores it and rank 0 hands the restored policy to the
    controller, which rewinds the job to that step, before the first pull.
    """
    import ray
    import ray.train
    import ray.train.torch

    cfg = config["cfg"]
    controller = config["controller"]
    torch.set_num_threads(cfg.cluster.torch_threads)
    queue = ray.get(controller.get_queue.remote())
    # this worker's GPU when cluster.learner_gpus > 0 (Ray Train made it the current device), else
    # the CPU; simulated GPUs are accounted by Ray only
    simulated = cfg.cluster.simulated_gpus
    device = torch.device("cpu") if simulated else ray.train.torch.get_device()
    learner = Learner.from_config(cfg, config["model_path"], device)
    first = learner.rank == 0
    here = LearnerPlace(ray.get_runtime_context().get_node_id(), os.getpid())
    restarted = ray.get(controller.register_learner.remote(learner.rank, here))
    latest = latest_checkpoint(cfg.run_dir / "checkpoints")
    if latest is not None:  # resumed or restarted: continue from the newest complete checkpoint
        learner.load_state_dict(load_checkpoint(latest))
    if first and (latest is not None or restarted):
        weights = ray.put(learner.engine_state(cfg.worker_engine()))
        ray.get(controller.restore.remote(learner.version, [weights]))
    source = QueueSource(queue, cfg.train, first, learner.world_size)
    sink = ControllerSink(controller, cfg, first)
    while learner.version < cfg.train.steps:
        try:
            learner_step(learner, source, sink, cfg.train, cfg.run_dir if first else None)
        except CheckpointNotWritten as err:  # the disk is full: nothing more can be kept
            if first:
                ray.get(controller.abort.remote(str(err)))
            return
        except (TrainingStopped, UserInputError) as err:  # raised alike on every rank
            if first:  # rank 0 keeps what it has
                ray.get(controller.abort.remote(_save_last_good(learner, cfg, err)))
            return
    report: dict[str, object] = {"policy_version": learner.version}
    if first:
        final = learner.save(cfg.run_dir / "checkpoint-final", extra={"step": learner.version})
        report["checkpoint_dir"] = str(final)
    # The evaluations load weights rank 0's process owns, which go with it. Every rank waits, so
    # that none sits in report's barrier meanwhile (Ray Train warns of it every minute).
    ray.get(controller.evaluations_finished.remote())
    ray.train.report(report)  # every worker reports, the same number of times
