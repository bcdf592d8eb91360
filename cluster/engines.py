"""Ray actor options for rollout workers that run the vLLM engine (``engine.kind: vllm``).

One GPU: the actor takes the GPU of its one-bundle placement group and vLLM runs the model in the
actor's own process.
Tensor parallel (TP > 1): the vLLM 0.33 pattern (``examples/rl/rlhf_nccl.py`` in the vLLM repo;
``v1/executor/ray_utils.py`` ``initialize_ray_cluster``, ``v1/executor/ray_executor_v2.py``) is a
placement group of TP one-GPU bundles; the actor itself takes no GPU, sits in bundle 0 and captures
the group for its child tasks, so vLLM (``distributed_executor_backend="ray"``, set by
``VLLMEngine``) finds it with ``ray.util.get_current_placement_group()`` and starts one GPU worker
actor per bundle (``num_cpus=0, num_gpus=1``). Written from the vLLM source; not run here (no GPU).
vLLM's CPU build (``engine.vllm.device: cpu``) takes no GPU: its workers are placed like the
embedded engine's (``cluster/rollout_pool.py``).
"""

from __future__ import annotations

from typing import Any

from treegrpo_ray.config import VLLMConfig


def tensor_parallel_bundles(
    settings: VLLMConfig, num_cpus: float = 1, resources: dict[str, float] | None = None
) -> list[dict[str, float]]:
    """The placement group of a TP > 1 engine: one GPU per rank; bundle 0 also holds what the
    actor itself asks for, its CPUs and custom resources (``cluster.rollout_resources``), since
    an actor placed in a bundle can take only what that bundle reserved."""
    first = {"GPU": 1, "CPU": num_cpus, **(resources or {})}
    return [first] + [{"GPU": 1}] * (settings.tensor_parallel_size - 1)


def vllm_actor_options(
    settings: VLLMConfig, num_cpus: float = 1, resources: dict[str, float] | None = None
) -> dict[str, Any]:
    """Options for ``ray.remote(RolloutWorker).options(**...)`` running a ``VLLMEngine``, with
    the custom ``resources`` every rollout worker needs, in a placement group that the caller
    owns: remove it with ``ray.util.remove_placement_group(options["scheduling_strategy"].
    placement_group)`` when the worker is retired, otherwise its GPUs stay reserved until the job
    ends. TP = 1: one bundle, whose GPU the actor takes (vLLM runs in its process); TP > 1:
    ``STRICT_PACK`` (one node: TP traffic stays on NVLink/PCIe), the actor in bundle 0 without a
    GPU, capturing the group for vLLM's GPU workers. A group for every worker lets a job wait for
    its placement with a bound (``rollout_pool.wait_for_placement``).
    """
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    tensor_parallel = settings.tensor_parallel_size > 1
    group = placement_group(
        tensor_parallel_bundles(settings, num_cpus, dict(resources or {})),
        strategy="STRICT_PACK" if tensor_parallel else "PACK",
    )
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=group,
        placement_group_bundle_index=0,
        placement_group_capture_child_tasks=tensor_parallel,
    )
    return {
        "num_cpus": num_cpus,
        "num_gpus": 0 if tensor_parallel else 1,
        "resources": dict(resources or {}),
        "scheduling_strategy": strategy,
    }
