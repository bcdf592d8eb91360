"""``treegrpo plan``: a job's CPU memory per process and per node, before it starts; and the
check ``treegrpo train`` makes with it before a local run starts Ray."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from treegrpo_ray.config import JobConfig, node_memory_bytes
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.hub import resolve_policy_path
from treegrpo_ray.memory_plan import ModelSizes, NodePlan, local_node_plan
from treegrpo_ray.pretrained import prepare_model


def model_sizes(cfg: JobConfig, model_path: str | Path | None = None) -> ModelSizes:
    """The sizes of the policy at ``model_path`` (default ``architecture_path(cfg)``) with the
    job's LoRA settings."""
    path = architecture_path(cfg) if model_path is None else model_path
    config = AutoConfig.from_pretrained(str(resolve_policy_path(path)))
    return ModelSizes.of(config, cfg.model.lora)


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


def print_plan(cfg: JobConfig) -> int:
    """``treegrpo plan``: the table; exit code 0 when the job fits this node, 1 when not."""
    plan = node_plan(cfg, architecture_path(cfg))
    print(f"treegrpo plan: {cfg.name}, CPU memory with every worker on this node")
    print(plan.render())
    if cfg.engine.kind != "hf":
        print("(vLLM's rollout workers and their KV pool are not counted)")
    if cfg.cluster.learner_gpus > 0:
        print("(learner ranks on GPUs: their CPU memory is counted, not the GPUs')")
    return 0 if plan.fits() else 1


def check_memory(cfg: JobConfig, model_path: str | Path) -> None:
    """Refuse a local run (all workers on this node) whose plan passes the memory at which
    Ray's monitor starts killing workers; a job on a cluster is not checked here."""
    if cfg.cluster.address is not None or cfg.cluster.learner_gpus > 0:
        return
    plan = node_plan(cfg, model_path)
    if not plan.fits():
        raise UserInputError(plan.refusal())
