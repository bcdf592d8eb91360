"""Where a job's GPU workers go on a cluster of identical GPU nodes, and what each GPU holds
(``treegrpo plan --gpus-per-node G --nodes N``), before anything starts.

Placement is what Ray does with the job's requests, first fit: every rollout engine's tensor-
parallel group on one node (a placement-group bundle), then every learner rank. Per GPU: a
learner rank by ``memory_plan.gpu_learner_plan``; a vLLM engine takes
``gpu_memory_utilization`` of each of its GPUs, the weights' share in the engine's dtype, and
what is left is its KV pool and its own activations (vLLM measures those at start).
"""

from __future__ import annotations

from dataclasses import dataclass

from treegrpo_ray.config import JobConfig
from treegrpo_ray.memory_plan import GB, ModelSizes, ProcessPlan, Term, gpu_learner_plan

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Placed:
    """A worker and the GPUs it takes: ``gpus`` from ``first_gpu`` on ``node``."""

    what: str
    node: int
    first_gpu: int
    gpus: float  # Ray accepts fractions of a GPU for a learner rank


@dataclass(frozen=True)
class GpuPlan:
    """Placement and per-GPU memory of a job on ``nodes`` x ``gpus_per_node`` GPUs of
    ``gpu_bytes`` each."""

    nodes: int
    gpus_per_node: int
    gpu_bytes: int
    placed: tuple[Placed, ...]
    unplaced: tuple[str, ...]
    learner: ProcessPlan | None
    engine: ProcessPlan | None
    advice: tuple[str, ...]

    @property
    def learner_fits(self) -> bool:
        return self.learner is None or self.learner.nbytes <= self.gpu_bytes

    @property
    def engine_fits(self) -> bool:
        return self.engine is None or all(t.nbytes >= 0 for t in self.engine.terms)

    def fits(self) -> bool:
        return not self.unplaced and self.learner_fits and self.engine_fits

    def render(self) -> str:
        lines = [
            f"GPUs: {self.nodes} node(s) x {self.gpus_per_node} GPUs of "
            f"{self.gpu_bytes / GB:.0f} GB (--nodes, --gpus-per-node, --gpu-memory)",
            "placement (first fit, as Ray places the job's requests):",
        ]
        for node in range(self.nodes):
            here = [p for p in self.placed if p.node == node]
            taken = ", ".join(f"{_gpus(p)} {p.what}" for p in here) or "nothing"
            lines.append(f"  node {node}: {taken}")
        lines += [f"  CANNOT BE PLACED: {what}" for what in self.unplaced]
        for plan, fits in ((self.learner, self.learner_fits), (self.engine, self.engine_fits)):
            if plan is None:
                continue
            lines.append(f"per GPU, {plan.name}:")
            lines += [f"  {t.nbytes / GB:8.2f} GB  {t.what}" for t in plan.terms]
            verdict = "fits" if fits else "DOES NOT FIT"
            lines.append(
                f"  {plan.nbytes / GB:8.2f} GB  of {self.gpu_bytes / GB:.0f} GB: {verdict}"
            )
        lines += [f"to fit: {line}" for line in self.advice]
        return "\n".join(lines)


def _gpus(placed: Placed) -> str:
    if placed.gpus < 1:
        return f"{placed.gpus:g} of GPU {placed.first_gpu}"
    last = placed.first_gpu + int(placed.gpus) - 1
    return f"GPU {placed.first_gpu}" if placed.gpus == 1 else f"GPUs {placed.first_gpu}-{last}"


def place(cfg: JobConfig, node_gpus: list[float]) -> tuple[list[Placed], list[str]]:
    """First fit of the rollout engines' TP groups (each on one node), then the learner ranks,
    on nodes with ``node_gpus`` GPUs each."""
    free = list(node_gpus)
    requests: list[tuple[str, float]] = [
        (f"rollout engine {i} (TP {cfg.engine.rollout_gpus()})", cfg.engine.rollout_gpus())
        for i in range(cfg.cluster.rollout_workers)
        if cfg.engine.rollout_gpus() > 0
    ]
    gpus = cfg.cluster.learner_gpus
    if gpus > 0:
        requests += [(f"learner rank {i}", gpus) for i in range(cfg.cluster.learner_workers)]
    placed, unplaced = [], []
    for what, count in requests:
        node = next((n for n in range(len(free)) if free[n] >= count), None)
        if node is None:
            unplaced.append(f"{what}: needs {count:g} GPU(s) on one node, no node has them left")
            continue
        placed.append(Placed(what, node, int(node_gpus[node] - free[node]), count))
        free[node] -= count
    return placed, unplaced


def unplaceable(cfg: JobConfig, node_gpus: list[float]) -> str | None:
    """Why the job's GPU workers cannot all be placed on nodes of ``node_gpus`` GPUs (one line,
    with what to change), or None when they can."""
    _, unplaced = place(cfg, node_gpus)
    if not unplaced:
        return None
    nodes = ", ".join(f"{gpus:g}" for gpus in node_gpus) or "none"
    return (
        f"the job cannot be placed: {unplaced[0]} (this cluster's nodes have {nodes} GPUs); "
        "lower engine.vllm.tensor_parallel_size, cluster.learner_gpus or the worker counts, "
        "or add a node with more GPUs (`treegrpo plan CONFIG --nodes N --gpus-per-node G`)"
    )


def engine_plan(cfg: JobConfig, sizes: ModelSizes, gpu_bytes: int) -> ProcessPlan | None:
    """One GPU of a vLLM rollout engine: its budget split into the weights' share and the rest
    (KV pool and vLLM's activations); the rest goes negative when the weights do not fit."""
    if cfg.engine.rollout_gpus() == 0:
        return None
    vllm = cfg.engine.vllm
    dtype = vllm.dtype if vllm.dtype != "auto" else "float32"
    budget = int(vllm.gpu_memory_utilization * gpu_bytes)
    weights = sizes.params * DTYPE_BYTES[dtype] // vllm.tensor_parallel_size
    kv_token = sizes.kv_token_bytes // sizes.param_bytes * DTYPE_BYTES[dtype]
    rest = budget - weights
    tokens = max(rest, 0) * vllm.tensor_parallel_size // kv_token
    terms = (
        Term(f"weights ({dtype}, / TP {vllm.tensor_parallel_size})", weights),
        Term(
            f"KV pool + vLLM's activations: ~{tokens / 1e3:.0f}k tokens of KV at most",
            rest,
            "engine.vllm.gpu_memory_utilization",
        ),
    )
    return ProcessPlan(
        f"rollout engine (vLLM, {vllm.gpu_memory_utilization:g} of each GPU)", 1, terms
    )


def learner_advice(cfg: JobConfig) -> list[str]:
    """The settings that shrink a learner rank, most effective first."""
    ppo = cfg.ppo
    advice = []
    if not ppo.activation_checkpointing:
        advice.append(
            "ppo.activation_checkpointing=true (a layer's input kept, the rest recomputed)"
        )
    advice.append(f"ppo.micro_batch_tokens={ppo.micro_batch_tokens // 2} (activations halve)")
    if not cfg.model.lora.enabled:
        advice.append("model.lora.enabled=true (no reference copy, no full gradients and Adam)")
    advice.append(
        "more learner ranks do not shrink a rank: they are data parallel, each holds the model"
    )
    return advice


def gpu_plan(
    cfg: JobConfig, sizes: ModelSizes, nodes: int, gpus_per_node: int, gpu_bytes: int
) -> GpuPlan:
    placed, unplaced = place(cfg, [gpus_per_node] * nodes)
    learner = gpu_learner_plan(cfg, sizes) if cfg.cluster.learner_gpus > 0 else None
    engine = engine_plan(cfg, sizes, gpu_bytes)
    advice: list[str] = []
    if learner is not None and learner.nbytes > gpu_bytes:
        advice += learner_advice(cfg)
    if engine is not None and engine.terms[-1].nbytes < 0:
        advice.append("engine.vllm.tensor_parallel_size (the weights split over more GPUs)")
    if unplaced:
        advice.append("more GPUs per node or nodes, or fewer cluster.rollout_workers")
    return GpuPlan(
        nodes,
        gpus_per_node,
        gpu_bytes,
        tuple(placed),
        tuple(unplaced),
        learner,
        engine,
        tuple(advice),
    )
