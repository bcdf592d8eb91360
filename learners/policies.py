"""Which policy a job's workers load (no Ray: tests and the device check use it too)."""

from __future__ import annotations

from pathlib import Path

from treegrpo_ray.config import JobConfig
from treegrpo_ray.envs.search_qa import check_model_path
from treegrpo_ray.learners.protocol_warmstart import protocol_warm_start
from treegrpo_ray.learners.warmstart import warm_start
from treegrpo_ray.modeling import check_policy_dir
from treegrpo_ray.tooling.pretrained import prepare_model


def resolve_model_path(cfg: JobConfig, progress: bool = True) -> str:
    """The policy the workers load: ``model.path`` (checked on this node), the packaged pretrained
    model warm-started on the protocol, or the warm-started tiny model (both prepared once, then
    cached). A local directory comes back absolute; a Hugging Face Hub id comes back as written,
    for each worker to resolve in its own node's cache (``resolve_policy_path``)."""
    if cfg.model.path is not None:
        check_policy_dir(cfg.model.path)
        local = Path(cfg.model.path).expanduser()
        return str(local.resolve()) if local.is_dir() else cfg.model.path
    if cfg.model.pretrained is not None:
        base = prepare_model(cfg.model.pretrained)
        if cfg.warmstart.steps == 0:
            return str(base)
        return str(protocol_warm_start(cfg, base, progress=progress))
    check_model_path(cfg.task.name, None)  # the tiny model reads multihop only
    return str(warm_start(cfg.task.multihop, cfg.model.tiny, cfg.warmstart, progress=progress))
