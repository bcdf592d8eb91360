"""``treegrpo plan``: a job's CPU memory per process and per node, and with GPUs where its GPU
workers go and what each GPU holds, before it starts; and the check ``treegrpo train`` makes
with the CPU plan before a local run starts Ray."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from transformers import AutoConfig

from treegrpo_ray.config import JobConfig, node_memory_bytes
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.gpu_plan import gpu_plan
from treegrpo_ray.hub import resolve_policy_path
from treegrpo_ray.memory_plan import (
    ACTION_SHARE,
    GB,
    ModelSizes,
    NodePlan,
    RolloutLoad,
    expected_rollout_worker,
    local_node_plan,
)
from treegrpo_ray.tooling.pretrained import prepare_model

ARCHITECTURES = Path(str(resources.files("treegrpo_ray").joinpath("presets", "architectures")))


def model_sizes(cfg: JobConfig, model_path: str | Path | None = None) -> ModelSizes:
    """The sizes of the policy at ``model_path`` (default ``architecture_path(cfg)``) with the
    job's LoRA settings."""
    path = architecture_path(cfg) if model_path is None else model_path
    config = AutoConfig.from_pretrained(str(_config_dir(path)))
    return ModelSizes.of(config, cfg.model.lora)


def _config_dir(path: str | Path) -> Path:
    """Where ``path``'s config.json is: the policy itself, or, for a GPU preset's model that is
    not on this machine, the config.json shipped for its architecture (planning needs no
    weights)."""
    try:
        return resolve_policy_path(path)
    except UserInputError:
        packaged = ARCHITECTURES / Path(str(path)).name
        if not (packaged / "config.json").is_file():
            raise
        print(f"(model {path} is not on this machine: its shape from {packaged}/config.json)")
        return packaged


def node_plan(cfg: JobConfig, model_path: str | Path) -> NodePlan:
    """The plan of ``cfg`` on this node, the policy's architecture read from ``model_path``."""
    return local_node_plan(cfg, model_sizes(cfg, model_path), node_memory_bytes())


def architecture_path(cfg: JobConfig) -> str | Path:
    """Where the policy's config.json is: ``model.path``, the packaged model as converted (its
    warm start changes no shape), or the warm-started tiny model (built once, cached)."""
    if cfg.model.path is not None:
        return cfg.model.path
    if cfg.model.pretrained is not None:
        return prepare_model(cfg.model.pretrained)
    from treegrpo_ray.learners.policies import resolve_model_path

    return resolve_model_path(cfg)


def print_plan(
    cfg: JobConfig, gpus: GpuCluster | None = None, trees_run: Path | None = None
) -> int:
    """``treegrpo plan``: a job that uses GPUs (or given ``gpus``) gets the GPU plan, any other
    the CPU table of this node, and with ``trees_run`` (a run with saved trees) what a rollout
    worker is expected to reach at the job's load; exit code 0 when it fits, 1 when not."""
    uses_gpus = cfg.cluster.learner_gpus > 0 or cfg.engine.rollout_gpus() > 0
    if uses_gpus or gpus is not None:
        return _print_gpu_plan(cfg, gpus or GpuCluster.for_job(cfg))
    sizes = model_sizes(cfg, architecture_path(cfg))
    plan = local_node_plan(cfg, sizes, node_memory_bytes())
    print(f"treegrpo plan: {cfg.name}, CPU memory with every worker on this node")
    print(plan.render())
    if cfg.engine.kind != "hf":
        print("(vLLM's rollout workers and their KV pool are not counted)")
    elif trees_run is not None:
        load, step = run_load(trees_run)
        expected = expected_rollout_worker(cfg, sizes, plan.processes[0].count, load)
        print(
            f"\nat this job's load, with the episodes of {trees_run} (update {step}: "
            f"{load.leaves} leaves, longest {load.longest_tokens} tokens):"
        )
        print(expected.render())
    return 0 if plan.fits() else 1


def run_load(run_dir: Path) -> tuple[RolloutLoad, int]:
    """The episode lengths of ``run_dir``'s saved update with the longest episode (the policy
    a job's memory must hold at its longest), and that update's step."""
    from treegrpo_ray.saved_trees import read_saved_trees, saved_steps, saved_trees_as_trees

    loads = {}
    for step in saved_steps(run_dir):  # raises, saying what to give, where none were saved
        table, _ = read_saved_trees(run_dir, step)
        loads[step] = RolloutLoad.of_trees(saved_trees_as_trees(table))
    step = max(loads, key=lambda s: loads[s].longest_tokens)
    return loads[step], step


@dataclass(frozen=True)
class GpuCluster:
    """The GPU nodes a plan is made for (``--nodes``, ``--gpus-per-node``, ``--gpu-memory``)."""

    nodes: int
    gpus_per_node: int
    gpu_gb: float = 80.0

    @classmethod
    def for_job(cls, cfg: JobConfig) -> GpuCluster:
        """One node with as many GPUs as the job asks for, 80 GB each (an H100 or A100)."""
        cluster = cfg.cluster
        need: float = cluster.rollout_workers * cfg.engine.rollout_gpus()
        need += cluster.learner_workers * cluster.learner_gpus
        return cls(nodes=1, gpus_per_node=max(int(need), 1))


def _print_gpu_plan(cfg: JobConfig, gpus: GpuCluster) -> int:
    plan = gpu_plan(cfg, model_sizes(cfg), gpus.nodes, gpus.gpus_per_node, int(gpus.gpu_gb * GB))
    print(f"treegrpo plan: {cfg.name}")
    print(plan.render())
    print(
        f"(the learner's LM head term assumes {ACTION_SHARE:.0%} of a row's tokens are action "
        "tokens; CPU memory of the processes is not counted here)"
    )
    return 0 if plan.fits() else 1


def check_memory(cfg: JobConfig, model_path: str | Path) -> None:
    """Refuse a local run (all workers on this node) whose plan passes the memory at which
    Ray's monitor starts killing workers; a job on a cluster is not checked here."""
    if cfg.cluster.address is not None or cfg.cluster.learner_gpus > 0:
        return
    plan = node_plan(cfg, model_path)
    if not plan.fits():
        raise UserInputError(plan.refusal())
