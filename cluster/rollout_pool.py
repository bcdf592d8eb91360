"""The rollout workers of one job as restartable Ray actors, each in its own placement group.

A worker is created with ``max_restarts`` (a killed worker comes back as a fresh instance, on the
initial policy) and ``max_task_retries=0`` (the lease it was running fails instead of being
replayed on an instance with the wrong policy): the job state re-issues the lease, and the
restarted instance, once a probe call answers, gets the current policy before its next lease
(``cluster/job_state.py``).
Workers are added and retired one by one (``treegrpo scale``); each worker's placement group
reserves ``cluster.rollout_cpus`` and ``cluster.rollout_resources`` on one node.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, OutOfMemoryError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.cluster.engines import vllm_actor_options
from treegrpo_ray.cluster.job_state import WorkerDeath
from treegrpo_ray.cluster.memory_kills import short_failure
from treegrpo_ray.config import JobConfig
from treegrpo_ray.modeling import PromptFormat

logger = logging.getLogger(__name__)


@dataclass
class PoolWorker:
    """One worker's actor and the placement group it runs in."""

    handle: Any
    group: PlacementGroup | None


def _actor_options(cfg: JobConfig) -> tuple[dict[str, Any], PlacementGroup | None]:
    """Actor options of one rollout worker and the placement group they schedule into."""
    common = {
        "max_restarts": cfg.cluster.rollout_max_restarts,
        "max_task_retries": 0,
        "runtime_env": {"env_vars": cfg.omp_env()},  # merged with the job's own
    }
    if cfg.engine.rollout_gpus():
        options = vllm_actor_options(
            cfg.engine.vllm, cfg.cluster.rollout_cpus, cfg.cluster.rollout_resources
        )
        strategy = options.get("scheduling_strategy")
        return {**options, **common}, strategy.placement_group if strategy else None
    bundle = {"CPU": cfg.cluster.rollout_cpus, **cfg.cluster.rollout_resources}
    group = placement_group([bundle])
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=0
    )
    options = {
        "num_cpus": cfg.cluster.rollout_cpus,
        "resources": dict(cfg.cluster.rollout_resources),
        "scheduling_strategy": strategy,
    }
    return {**options, **common}, group


async def wait_for_placement(groups: list[PlacementGroup | None], timeout: float) -> int:
    """Wait up to ``timeout`` s for the placement groups to be reserved; returns how many were
    not (None stands for a worker without a group of its own)."""
    ready = [g.ready().as_future() for g in groups if g is not None]
    if not ready:
        return 0
    _, pending = await asyncio.wait(ready, timeout=timeout)
    for future in pending:
        future.cancel()
    return len(pending)


class RolloutPool:
    """The job's rollout worker actors by id (``JobState`` decides which exist; this class
    starts, syncs and stops them on Ray)."""

    def __init__(self, cfg: JobConfig, model_path: str, search: Any = None):
        self.cfg = cfg
        self.model_path = model_path
        self.search = search  # passed to every worker's environment (search_qa's retriever)
        self.workers: dict[int, PoolWorker] = {}
        largest = max(n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"])
        self.workers_per_node = cfg.rollout_workers_per_node(largest)  # share the KV budget

    def start(self, worker_id: int) -> None:
        """Start worker ``worker_id`` on the initial policy, in a placement group of its own."""
        options, group = _actor_options(self.cfg)
        engine = self.cfg.worker_engine()
        handle = (
            ray.remote(RolloutWorker)
            .options(**options)
            .remote(
                self.model_path,
                self.cfg.task,
                self.cfg.tree,
                self.cfg.sampling,
                engine,
                seed=self.cfg.train.seed + worker_id,
                torch_threads=self.cfg.cluster.torch_threads,
                search=self.search,
                lora=engine.adapter_updates(self.cfg.model.lora.enabled),
                prompt_format=PromptFormat.of(self.cfg.model),
                workers_on_node=self.workers_per_node,
            )
        )
        self.workers[worker_id] = PoolWorker(handle, group)

    def placement_error(self, unplaced: int, timeout: float) -> ValueError:
        """The error for ``unplaced`` workers whose placement group was not reserved in time."""
        return ValueError(
            f"{unplaced} new rollout worker(s) could not be placed in {timeout:g} s: each "
            f"needs {self.cfg.rollout_worker_resources()} and the cluster has "
            f"{ray.available_resources()} free; add nodes or lower cluster.rollout_cpus"
        )

    def check_room(self, active: int, more: int) -> None:
        """Refuse at once (ValueError, with the arithmetic) ``more`` workers that the cluster
        cannot hold even if everything this job does not hold were free: its totals minus what
        the job reserves with its ``active`` workers (a wait could only end at the timeout)."""
        cfg = self.cfg
        total, held = ray.cluster_resources(), cfg.required_resources(active)
        short = []
        for key, each in cfg.rollout_worker_resources().items():
            room = total.get(key, 0.0) - held.get(key, 0.0)
            if more * each > room + 1e-9:
                short.append(
                    f"{more * each:g} {key} ({each:g} each) but the cluster has "
                    f"{total.get(key, 0.0):g} and this job holds {held.get(key, 0.0):g} with "
                    f"{active} rollout worker(s): {room:g} left"
                )
        if short:
            raise ValueError(
                f"{more} more rollout worker(s) need {'; and '.join(short)}; add nodes with "
                "these resources or scale to fewer workers"
            )

    def sync(self, worker_id: int, version: int, weights: ray.ObjectRef) -> ray.ObjectRef:
        """Send policy ``version`` to a worker (ordered before any later call to it)."""
        return self.workers[worker_id].handle.load_weights.remote(version, weights)

    def handles(self) -> list[Any]:
        return [w.handle for w in self.workers.values()]

    def stop(self, worker_id: int) -> None:
        """Stop a worker and free its placement group."""
        worker = self.workers.pop(worker_id)
        ray.kill(worker.handle, no_restart=True)
        if worker.group is not None:
            remove_placement_group(worker.group)

    def shutdown(self) -> None:
        for worker_id in list(self.workers):
            self.stop(worker_id)


def worker_death(worker_id: int, error: Exception) -> WorkerDeath:
    """How a worker died, from the error its call raised: Ray restarts it after
    ``ActorUnavailableError`` or ``OutOfMemoryError`` (its memory monitor killed it; a restart
    follows if restarts are left); ``ActorDiedError``: gone for good."""
    reason = short_failure(str(error)).splitlines()[-1]
    memory_kill = isinstance(error, OutOfMemoryError)
    if memory_kill:
        logger.warning("rollout worker %d: %s", worker_id, reason)
    restarting = isinstance(error, (ActorUnavailableError, OutOfMemoryError))
    return WorkerDeath(restarting, reason, memory_kill)
