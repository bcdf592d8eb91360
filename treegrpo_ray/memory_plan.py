"""What a job's processes hold in CPU memory, estimated before anything starts (``treegrpo plan``).

Per rollout worker with the embedded engine: the process runtime, the weights, their
oneDNN-packed copies (``engine.onednn_linears``) and blocked ones (``engine.small_rows_kernel``),
the prefix cache's budget (``engine.cache_bytes``), the running rows' KV bound
(``engine.max_kv_bytes``, or ``engine.max_num_seqs`` x ``engine.max_model_len``) and the freed
memory glibc keeps as the cache churns. Per learner rank: the runtime, the weights, the trained parameters with
their gradients and Adam state, the reference copy (full fine-tuning with a KL term; LoRA disables the adapter
instead), the packed frozen layers, and the activations one packed row of
``ppo.micro_batch_tokens`` keeps for the backward. Budgets count in full: the plan is what a
process may reach under load, not what a light step reaches. Given the trees of a short run of
the same task (``RolloutLoad``), ``expected_rollout_worker`` estimates what a rollout worker
reaches at the job's load instead: the running rows and their slots from the lease's leaves and
the longest episode, the prefix cache's fill from the lease's unique tokens.

Sizes come from the model's config, the model built on the meta device (no weights are read).
The constants were measured on this project's 2-core CPU nodes (README, "Sizing a CPU node").
``gpu_learner_plan`` is a learner rank on one GPU (its constants measured on an H200; placement
and the rollout engines' GPUs are ``treegrpo_ray.gpu_plan``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treegrpo_ray import TRIM_THRESHOLD_BYTES
from treegrpo_ray.config import JobConfig, LoraSettings
from treegrpo_ray.tree import Tree

GB = 10**9
# A process with torch, transformers and ray imported, before any model: 454 MB resident.
RUNTIME_BYTES = 450 * 10**6
# Besides the workers: the driver, the controller, Ray Train's and Ray Data's helper actors, the
# dashboard and runtime-env agents, raylet and GCS (proportional set sizes summed over a
# SmolLM2 job: 2.3 GB, most of it torch loaded in each process).
AUXILIARY_BYTES = 2_300 * 10**6
# Floats one token keeps for the backward, per layer: hidden-wide, the two norms' inputs and
# outputs, q, k and v, their rotated copies, the attention's output and log-sum-exp, the output
# projection's input, the residuals (~14); MLP-wide: gate, up, the activation, the product (~5).
# At the LM head, vocabulary-wide: logits, log-softmax, probabilities and entropy terms, and their
# gradients (~6). Checked against the learner's peak resident memory on SmolLM2 at 1024-token rows
# (README, "Memory: sizing a CPU node").
HIDDEN_WIDE, MLP_WIDE, VOCAB_WIDE = 14, 5, 6


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts and widths of a causal LM, from its config."""

    params: int
    linear_params: int  # in nn.Linear layers, the LM head counted even when tied
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    max_positions: int
    kv_token_bytes: int  # keys and values of one token over all layers
    param_bytes: int  # bytes per parameter (the dtype the model loads in)
    lora_params: int  # parameters of the LoRA adapter of the job's settings

    @classmethod
    def of(cls, config: Any, lora: LoraSettings, param_bytes: int = 4) -> ModelSizes:
        """Sizes of the model ``config`` (a transformers ``PretrainedConfig``) describes."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        adapted = [m for n, m in linears.items() if n.rsplit(".", 1)[-1] in lora.target_modules]
        return cls(
            params=sum(p.numel() for p in model.parameters()),
            linear_params=sum(m.weight.numel() for m in linears.values()),
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            max_positions=config.max_position_embeddings,
            kv_token_bytes=2
            * config.num_hidden_layers
            * config.num_key_value_heads
            * head_dim
            * param_bytes,
            param_bytes=param_bytes,
            lora_params=sum(lora.rank * (m.in_features + m.out_features) for m in adapted),
        )


@dataclass(frozen=True)
class Term:
    """One thing a process holds: what, bytes, and the setting that changes it ("" if none)."""

    what: str
    nbytes: int
    setting: str = ""


@dataclass(frozen=True)
class ProcessPlan:
    """A kind of process, how many of it one node holds, and what each holds."""

    name: str
    count: int
    terms: tuple[Term, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.terms)

    def render(self) -> str:
        """The process's line and a line per term, with the setting that changes it."""
        lines = [f"{self.name} x{self.count}: {self.nbytes / GB:6.2f} GB each"]
        for term in self.terms:
            setting = f"  ({term.setting})" if term.setting else ""
            lines.append(f"    {term.what:<42} {term.nbytes / GB:6.2f} GB{setting}")
        return "\n".join(lines)


def kept_free_bytes() -> int:
    """Freed memory glibc may keep in a process (``treegrpo_ray.keep_freed_memory``): the prefix
    cache's entries are small allocations from the heap, and the heap of a worker whose cache
    evicts and inserts all the time stays up to this much above what it holds (measured: README,
    "Memory: sizing a CPU node")."""
    return 0 if os.environ.get("TREEGRPO_KEEP_FREED_MEMORY") == "0" else TRIM_THRESHOLD_BYTES


def _rollout_worker_base(cfg: JobConfig, sizes: ModelSizes) -> list[Term]:
    """What a rollout worker holds whatever its load: runtime, weights, their packed copies."""
    terms = [Term("runtime (Python, torch, Ray)", RUNTIME_BYTES)]
    terms.append(Term("weights", sizes.params * sizes.param_bytes))
    if cfg.engine.onednn_linears:
        packed = sizes.linear_params * sizes.param_bytes
        terms.append(Term("oneDNN-packed linear weights", packed, "engine.onednn_linears"))
        if cfg.engine.small_rows_kernel and sizes.param_bytes == 4:  # it blocks float32 alone
            terms.append(
                Term("small-rows kernel's blocked weights", packed, "engine.small_rows_kernel")
            )
    return terms


def _churn_term(cfg: JobConfig) -> Term:
    """The freed memory glibc keeps as the prefix cache churns, at most the cache's budget."""
    churn = min(kept_free_bytes(), cfg.engine.cache_bytes)
    return Term("freed memory glibc keeps (cache churn)", churn, "engine.cache_bytes")


def _slot_positions(cfg: JobConfig, sizes: ModelSizes) -> int:
    """Columns a KV slot may reach: ``engine.max_model_len`` (or the model's context) + scratch."""
    return min(sizes.max_positions, cfg.engine.max_model_len or sizes.max_positions) + 1


def rollout_worker_plan(cfg: JobConfig, sizes: ModelSizes, workers_on_node: int) -> ProcessPlan:
    """An embedded-engine rollout worker at its budgets (vLLM's pool is not counted here)."""
    engine = cfg.engine
    terms = _rollout_worker_base(cfg, sizes)
    if engine.prefix_cache:
        terms.append(Term("prefix cache budget", engine.cache_bytes, "engine.cache_bytes"))
    slots = engine.max_num_seqs * _slot_positions(cfg, sizes) * sizes.kv_token_bytes
    kv = min(engine.kv_budget(workers_on_node), slots)
    setting = "engine.max_kv_bytes" if kv < slots else "engine.max_num_seqs x max_model_len"
    terms.append(Term("running rows' KV bound", kv, setting))
    if engine.prefix_cache:
        terms.append(_churn_term(cfg))
    return ProcessPlan("rollout worker", workers_on_node, tuple(terms))


@dataclass(frozen=True)
class RolloutLoad:
    """Token counts of trees a rollout worker expanded (a short run of the same task and
    policy): what ``expected_rollout_worker`` scales to another load."""

    leaves: int
    unique_tokens: int  # prompts (once per group) and every node's action + observation tokens
    path_tokens: int  # the leaves' paths laid out flat, prompts included
    longest_tokens: int  # the longest leaf path

    @classmethod
    def of_trees(cls, trees: list[Tree]) -> RolloutLoad:
        prompts = {t.group_id: len(t.prompt_ids) for t in trees}
        paths = [t.path_token_count(leaf.node_id) for t in trees for leaf in t.leaves()]
        nodes = sum(n.token_count for t in trees for n in t.nodes)
        return cls(len(paths), sum(prompts.values()) + nodes, sum(paths), max(paths))


# A KV slot's columns grow to half again what the longest row asks for when it grows
# (``SlotKV.grown``), so they end between 1x and 1.5x the longest episode: the middle is taken
# (measured 1.07x and 1.10x on SmolLM2 at 56 and 168 leaves, README "Memory: sizing a CPU node").
SLOT_GROWTH = 1.25


def expected_rollout_worker(
    cfg: JobConfig,
    sizes: ModelSizes,
    workers_on_node: int,
    load: RolloutLoad,
    evaluation: bool = True,
) -> ProcessPlan:
    """What a rollout worker is expected to reach at ``cfg``'s load, its episodes as long as
    ``load``'s: slots for the rows that run at once (a lease's leaves, or with ``evaluation``
    the worker's share of the held-out questions, one chain each, if more; at most
    ``max_num_seqs``) of 1.25x the longest episode; the prefix cache filled with their unique
    tokens (the cache resets with each policy version); the freed memory glibc keeps once the
    cache evicts."""
    engine, kv_token = cfg.engine, sizes.kv_token_bytes
    leaves = cfg.lease_size() * cfg.tree.shape().leaves_per_prompt
    cached = leaves * load.unique_tokens // load.leaves
    if evaluation:
        episodes = -(-cfg.train.final_eval_questions // cfg.cluster.rollout_workers)
        cached = max(cached, episodes * load.path_tokens // load.leaves)
        leaves = max(leaves, episodes)
    terms = _rollout_worker_base(cfg, sizes)
    evicting = False
    if engine.prefix_cache:
        fill = cached * kv_token
        evicting = fill > engine.cache_bytes
        terms.append(Term("prefix cache fill", min(fill, engine.cache_bytes), "engine.cache_bytes"))
    columns = min(_slot_positions(cfg, sizes), int(SLOT_GROWTH * load.longest_tokens))
    slots = min(engine.max_num_seqs, leaves) * columns * kv_token
    kv = min(engine.kv_budget(workers_on_node), slots)
    terms.append(Term("running rows' KV", kv, "engine.max_kv_bytes, engine.max_num_seqs"))
    if evicting:
        terms.append(_churn_term(cfg))
    return ProcessPlan("rollout worker (expected at this load)", workers_on_node, tuple(terms))


def activation_bytes(sizes: ModelSizes, tokens: int) -> int:
    """What one packed row of ``tokens`` keeps for the backward, with its dense tree mask."""
    per_layer = HIDDEN_WIDE * sizes.hidden + MLP_WIDE * sizes.intermediate
    per_token = sizes.layers * per_layer + VOCAB_WIDE * sizes.vocab
    return tokens * per_token * 4 + tokens * tokens


def learner_plan(cfg: JobConfig, sizes: ModelSizes, ranks_on_node: int) -> ProcessPlan:
    """A CPU learner rank."""
    lora = cfg.model.lora.enabled
    weights = sizes.params * sizes.param_bytes
    trained = sizes.lora_params if lora else sizes.params
    terms = [
        Term("runtime (Python, torch, Ray)", RUNTIME_BYTES),
        Term("weights", weights),
        Term("trained parameters, gradients, Adam state", 4 * trained * 4, "model.lora"),
    ]
    reference = not lora and cfg.ppo.uses_reference()
    if reference:
        terms.append(Term("reference copy", weights, "model.lora, ppo.kl_coef"))
    if cfg.ppo.onednn_linears and cfg.ppo.precision == "float32" and (lora or reference):
        copies = 2 if lora else 1  # LoRA: each frozen layer and its transpose; else the reference
        packed = copies * sizes.linear_params * sizes.param_bytes
        terms.append(Term("oneDNN-packed frozen weights", packed, "ppo.onednn_linears"))
    tokens = cfg.ppo.micro_batch_tokens
    terms.append(
        Term(
            f"activations of a {tokens}-token row",
            activation_bytes(sizes, tokens),
            "ppo.micro_batch_tokens",
        )
    )
    return ProcessPlan("learner rank", ranks_on_node, tuple(terms))


# A learner rank on a GPU, fitted to one H200's peak allocated memory (device check of 2026-12-04,
# benchmarks/results/device_check/plan_grid.json) from what each tensor is:
# Bytes one token keeps for the backward, per decoder layer: float32, ~10 hidden-wide tensors
# (norm inputs and outputs, q / k / v and their rotated copies, attention output, projection
# input, residual) and ~4 MLP-wide (gate, up, activation, product), 4 bytes each; under bfloat16
# autocast the ~4 on the float32 residual stream stay 4 bytes and the matmul outputs (~6 hidden,
# ~4 MLP) take 2.
GPU_LAYER_HIDDEN_BYTES = {"float32": 40, "bfloat16-mixed": 28}
GPU_LAYER_MLP_BYTES = {"float32": 16, "bfloat16-mixed": 8}
# Bytes per action token and vocabulary entry at the LM head, computed only where an action token
# is predicted: the logits (2 or 4 bytes), their float32 copy gathered per action token, the
# log-softmax and the probabilities kept for the backward, and transients.
GPU_VOCAB_BYTES = {"float32": 22, "bfloat16-mixed": 20}
# The share of a row's tokens that are action tokens (the rest: prompts and observations); what
# the LM head's term scales with. Search-R1 style trees run at ~0.1-0.3 (long retrieved passages).
ACTION_SHARE = 0.3


def gpu_activation_bytes(
    sizes: ModelSizes, tokens: int, precision: str, checkpointing: bool, action_share: float
) -> int:
    """What one packed row of ``tokens`` holds at its peak on a GPU, with the flex block mask (no
    n² mask): the layers' saved tensors (with ``checkpointing``, each layer's float32 input
    only: the one layer recomputed at a time is smaller than the LM head's part), the LM head's
    vocabulary-wide tensors at the action tokens, and under bfloat16 autocast the bfloat16 copies
    of the linear weights the backward needs (all of them; with checkpointing the LM head's)."""
    vocab = int(tokens * action_share) * sizes.vocab * GPU_VOCAB_BYTES[precision]
    mixed = precision == "bfloat16-mixed"
    if checkpointing:
        head_copy = 2 * sizes.vocab * sizes.hidden if mixed else 0
        return tokens * sizes.layers * sizes.hidden * 4 + vocab + head_copy
    per_layer = (
        GPU_LAYER_HIDDEN_BYTES[precision] * sizes.hidden
        + GPU_LAYER_MLP_BYTES[precision] * sizes.intermediate
    )
    weight_copies = 2 * sizes.linear_params if mixed else 0
    return tokens * sizes.layers * per_layer + vocab + weight_copies


def gpu_learner_plan(
    cfg: JobConfig, sizes: ModelSizes, action_share: float = ACTION_SHARE
) -> ProcessPlan:
    """A learner rank on one GPU, in steady state (Adam's state already allocated while a row
    runs its backward): weights, reference (full fine-tuning with a KL term), gradients and Adam's moments of the
    trained parameters (12 bytes each), and the larger of a row's activations and the optimizer
    step's temporaries (4 bytes per trained parameter, torch's foreach Adam)."""
    ppo, lora = cfg.ppo, cfg.model.lora.enabled
    weights = sizes.params * sizes.param_bytes
    trained = sizes.lora_params if lora else sizes.params
    terms = [
        Term("weights", weights),
        Term("gradients and Adam state of the trained parameters", 12 * trained, "model.lora"),
    ]
    if not lora and ppo.uses_reference():
        terms.append(Term("reference copy", weights, "model.lora, ppo.kl_coef"))
    tokens = ppo.micro_batch_tokens
    activations = gpu_activation_bytes(
        sizes, tokens, ppo.precision, ppo.activation_checkpointing, action_share
    )
    settings = "ppo.micro_batch_tokens, ppo.activation_checkpointing"
    terms.append(Term(f"activations of a {tokens}-token row", activations, settings))
    step = 4 * trained
    if step > activations:
        terms.append(Term("optimizer step temporaries beyond the activations", step - activations))
    return ProcessPlan("learner rank (GPU)", 1, tuple(terms))


@dataclass(frozen=True)
class NodePlan:
    """Every process of a job on one node, against the memory at which Ray starts killing."""

    processes: tuple[ProcessPlan, ...]
    node_bytes: int
    kill_share: float  # RAY_memory_usage_threshold

    @property
    def nbytes(self) -> int:
        return sum(p.count * p.nbytes for p in self.processes) + AUXILIARY_BYTES

    @property
    def limit(self) -> int:
        return int(self.node_bytes * self.kill_share)

    def fits(self) -> bool:
        return self.nbytes <= self.limit

    def render(self) -> str:
        """The plan as a table: each process kind, its terms, the node's total and verdict."""
        lines = [process.render() for process in self.processes]
        lines.append(
            f"driver, controller, retriever, Ray's own processes: {AUXILIARY_BYTES / GB:.2f} GB"
        )
        verdict = "fits" if self.fits() else "does NOT fit"
        lines.append(
            f"node total {self.nbytes / GB:.2f} GB of {self.limit / GB:.2f} GB "
            f"({self.kill_share:.0%} of {self.node_bytes / GB:.1f} GB, where Ray's memory "
            f"monitor starts killing workers): {verdict}"
        )
        return "\n".join(lines)

    def refusal(self) -> str:
        """Why the job does not fit, with the settings that shrink it most."""
        largest = sorted(
            (t for p in self.processes for t in p.terms if t.setting),
            key=lambda t: -t.nbytes,
        )[:3]
        hints = ", ".join(f"{t.setting} ({t.what}: {t.nbytes / GB:.2f} GB)" for t in largest)
        return (
            f"the job needs ~{self.nbytes / GB:.1f} GB on this node but Ray starts killing "
            f"workers at {self.limit / GB:.1f} GB; lower {hints}, or fewer workers per node "
            "(`treegrpo plan CONFIG` shows every term)"
        )


def kill_share() -> float:
    """The node memory share above which Ray's memory monitor kills workers."""
    return float(os.environ.get("RAY_memory_usage_threshold", "0.95"))  # noqa: SIM112 (Ray's name)


def node_memory_used_share() -> float:
    """The share of this node's memory in use as Ray's monitor counts it: total less available
    (``/proc/meminfo``), or a cgroup v2 limit and its usage where one is set; 0 where the kernel
    does not say (not Linux)."""
    info = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0.0
    total, used = info["MemTotal"], info["MemTotal"] - info["MemAvailable"]
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and int(limit) < total:
            total, used = int(limit), int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        pass
    return used / total


PRESSURE_MARGIN = 0.05  # the engine stops admitting rows this far below Ray's kill threshold


def near_kill_threshold() -> bool:
    """Whether this node's memory use is within ``PRESSURE_MARGIN`` of Ray's kill threshold."""
    return node_memory_used_share() >= kill_share() - PRESSURE_MARGIN


def local_node_plan(cfg: JobConfig, sizes: ModelSizes, node_bytes: int) -> NodePlan:
    """The plan of a job on one node holding all its workers (a local run)."""
    processes = [learner_plan(cfg, sizes, cfg.cluster.learner_workers)]
    if cfg.engine.kind == "hf":
        workers = cfg.cluster.rollout_workers
        processes.insert(0, rollout_worker_plan(cfg, sizes, workers))
    return NodePlan(tuple(processes), node_bytes, kill_share())
