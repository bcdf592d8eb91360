"""The learning side: a plain ``Learner`` (PPO update on trees) and its Ray Train loop.

The ``Learner`` runs in-process in unit tests; ``train_loop_per_worker`` runs it inside a Ray Train
``TorchTrainer`` worker, pulling tree batches from the queue and publishing each new policy version
through the controller.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import TYPE_CHECKING, Any, cast

import torch

from treegrpo_ray.advantage import RoutedAdvantages, chain_grpo_advantages, tree_grpo_advantages
from treegrpo_ray.budget import Budget
from treegrpo_ray.config import EngineConfig, JobConfig, LoraSettings, PPOConfig
from treegrpo_ray.engine import LoraPayload
from treegrpo_ray.errors import TrainingStopped, UserInputError
from treegrpo_ray.learners.checkpoint import (
    CheckpointNotWritten,
    LearnerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from treegrpo_ray.learners.distributed import (
    all_agree,
    broadcast_from_first,
    deal_rows,
    sum_gradients,
    sum_stats,
    world,
)
from treegrpo_ray.loss import PPOCoefficients, routed_ppo_loss, truncated_is_weights
from treegrpo_ray.metrics import (
    budget_metrics,
    peak_rss_bytes,
    prefix_cache_metrics,
    timed,
    tree_metrics,
)
from treegrpo_ray.modeling import load_policy
from treegrpo_ray.modifiers import node_modifiers, reward_normalizer
from treegrpo_ray.onednn_linear import OneDNNLinears, onednn_available
from treegrpo_ray.packing import PackedBatch, pack_trees
from treegrpo_ray.saved_trees import (
    NodeAdvantage,
    node_advantages,
    saved_trees_table,
    should_save,
    write_saved_trees,
)
from treegrpo_ray.stops import Decode
from treegrpo_ray.tree import Tree, batch_info, trees_from_arrow
from treegrpo_ray.tree_attention import TREE_FLEX

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# A policy: a transformers PreTrainedModel, or a peft PeftModel around one. Both forward
# attributes at run time (config, get_base_model, disable_adapter, peft_config...) that their
# stubs do not show through torch.nn.Module, so code that reads them takes it untyped.
Policy = Any


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each next-token distribution, on a
    path-expanded batch (the reference layout, ``packing.expand_paths``).

    input_ids, attention_mask: (B, T). Returns ``(logprobs, entropy)``, both (B, T-1), under
    ``softmax(logits / temperature)`` (the distribution the rollout sampled from).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    row: int,
    temperature: float = 1.0,
    mask_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each action token of packed ``row`` given its own path, and the entropy of the
    distribution it was drawn from, in one forward of the row's real tokens with the tree mask.

    Action token t reads the logits at ``batch.prev_index[row, t]``; the LM head runs only at
    those positions (``logits_to_keep``). Returns ``(logprobs, entropy)``, both (T,) float32 on
    the batch's device, 0 off action tokens, under ``softmax(logits / temperature)``. The model
    must use ``sdpa``, ``eager`` or ``tree_flex`` (``treegrpo_ray.tree_attention``; see ``treegrpo_ray.packing``); a dense
    tree mask is built in ``mask_dtype`` (default: the model's), the dtype its attention computes
    in.
    """
    n = batch.row_length(row)
    input_ids = batch.input_ids[row, :n]
    (pos,) = batch.loss_mask[row].nonzero(as_tuple=True)
    # logits only where an action token is predicted (a branch point predicts several)
    predictors, which = torch.unique(batch.prev_index[row, pos], return_inverse=True)
    logits = model(
        input_ids=input_ids[None],
        attention_mask=_tree_mask_for(model, batch, row, mask_dtype),
        position_ids=batch.position_ids[row, None, :n],
        use_cache=False,
        logits_to_keep=predictors,
    ).logits[0]
    log_probs = torch.log_softmax(logits[which].float() / temperature, -1)
    action_logprobs = log_probs.gather(-1, input_ids[pos, None]).squeeze(-1)
    action_entropy = -(log_probs.exp() * log_probs).sum(-1)
    width = batch.input_ids.shape[1]
    logprobs = torch.zeros(width, device=pos.device).index_put((pos,), action_logprobs)
    entropy = torch.zeros(width, device=pos.device).index_put((pos,), action_entropy)
    return logprobs, entropy


def _tree_mask_for(
    model: Policy, batch: PackedBatch, row: int, dtype: torch.dtype | None
) -> torch.Tensor | BlockMask:
    """The tree mask of packed ``row`` in the form ``model``'s attention takes."""
    attention = model.config._attn_implementation
    if attention == TREE_FLEX:
        return batch.flex_block_mask(row)
    if attention not in ("sdpa", "eager"):
        raise ValueError(
            f"packed training needs sdpa, eager or {TREE_FLEX} attention (a tree mask), the "
            f"model uses {attention}; set ppo.attention"
        )
    return batch.attention_bias(row, dtype or next(model.parameters()).dtype)


def attention_implementation(setting: str, device: torch.device) -> str:
    """transformers' ``attn_implementation`` for ``ppo.attention`` on ``device``."""
    if setting == "flex" and device.type != "cuda":
        raise UserInputError(
            f"ppo.attention=flex needs a CUDA learner (this one is on {device.type}): PyTorch's "
            "flex_attention has no backward pass there; set ppo.attention to auto or sdpa"
        )
    if setting in ("flex", "auto") and device.type == "cuda":
        return TREE_FLEX
    return "sdpa"


@torch.no_grad()
def merged_lora_state(model: Policy) -> dict[str, torch.Tensor]:
    """The state dict (base model names) that peft's ``merge_and_unload`` would leave, without
    changing ``model``: each LoRA layer's weight plus its active adapters' deltas."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layer: Any = module  # get_delta_weight: defined by each LoRA layer type
            deltas[f"{name}.base_layer.weight"] = cast(
                torch.Tensor, sum(layer.get_delta_weight(a) for a in layer.active_adapters)
            )
    return {
        key.replace(".base_layer.", "."): value + deltas[key] if key in deltas else value
        for key, value in base.state_dict().items()
        if ".lora_" not in key
    }


@dataclass
class Minibatch:
    """The trees of one optimizer step, packed, with what the loss needs per token (R, T)."""

    batch: PackedBatch
    routed: RoutedAdvantages
    ref_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None  # None: the training forward's own, detached
    stale: torch.Tensor | None  # (R, T) action tokens of older policies to reweight; None: none

    @property
    def denominator(self) -> float:
        """Token count of the token-mean: path-expanded action tokens in ``paper`` mode."""
        return max(float((self.batch.loss_mask * self.routed.weights).sum()), 1.0)


def with_lora_adapter(model: Policy, lora: LoraSettings) -> Policy:
    """``model`` wrapped by peft with a fresh LoRA adapter; only the adapter is trainable."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # typed int; peft scales by alpha / r
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
    )
    return get_peft_model(model, config)


NONFINITE_LIMIT = 3  # skipped (non-finite) updates in a row that stop a run


class Learner:
    """Routed PPO on tree-packed batches with a frozen reference copy of the initial policy.

    temperature: the rollout temperature (log-probs are computed under the same distribution).
    ``ppo.advantage``: ``tree`` (intra + inter, paper) or ``chain`` (prompt-level GRPO over all
    leaves).
    Each optimizer step takes one minibatch of whole trees, packed into rows of at most
    ``ppo.micro_batch_tokens`` tokens (a larger tree split by subtree, ``packing.pack_trees``);
    every row is one forward and backward, its loss divided by the minibatch's token count, so
    the accumulated gradient is the full-minibatch one. Trees are
    split into ``ppo.minibatches`` minibatches once per update; each epoch visits them in a new
    order. With one minibatch, ``paper`` mode gives exactly the path-expanded update.
    The policy, its reference and every packed batch live on ``device`` (a Ray Train worker's
    GPU, or the CPU); trees are packed and advantages routed on the CPU, then moved there.
    """

    def __init__(
        self,
        model_path: str,
        ppo: PPOConfig,
        temperature: float,
        seed: int = 0,
        lora: LoraSettings | None = None,
        device: torch.device | str = "cpu",
    ):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model: Policy
        self.model, self.tokenizer = load_policy(model_path)
        self.model.set_attn_implementation(attention_implementation(ppo.attention, self.device))
        if ppo.activation_checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model.to(self.device)
        self.lora = lora is not None and lora.enabled
        self.ref_model: torch.nn.Module | None = None
        if lora is not None and lora.enabled:
            self.model = with_lora_adapter(self.model, lora)
        else:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.model.train()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trainable, lr=ppo.lr)
        self.ppo = ppo
        self.temperature = temperature
        self.modifiers = node_modifiers(ppo.modifiers, ppo.kl_coef, ppo.entropy_coef)
        self.reward_norm = reward_normalizer(ppo.modifiers)  # running state, in checkpoints
        self.rng = random.Random(seed)
        self.rank, self.world_size = world()
        self.version = 0
        self.skipped_updates = 0
        self.skipped_in_a_row = 0
        # per (tree_id, node_id) of the last update's trees: what the loss gave each node
        self.node_advantages: dict[tuple[int, int], NodeAdvantage] = {}
        self.onednn = self._onednn_linears()

    @classmethod
    def from_config(
        cls, cfg: JobConfig, model_path: str, device: torch.device | str = "cpu"
    ) -> Learner:
        """The learner of a job (the Ray Train loop and the in-process loop build it alike)."""
        return cls(
            model_path,
            cfg.ppo,
            temperature=cfg.sampling.temperature,
            seed=cfg.train.seed,
            lora=cfg.model.lora,
            device=device,
        )

    @property
    def mixed_precision(self) -> bool:
        return self.ppo.precision == "bfloat16-mixed"

    def _onednn_linears(self) -> OneDNNLinears | None:
        """oneDNN-packed copies of the frozen linear layers on a CPU learner in float32
        (``ppo.onednn_linears``): a LoRA policy's base layers and LM head (their input gradients
        through packed transposes), or the full policy's reference copy."""
        if not (self.ppo.onednn_linears and onednn_available(self.device)) or self.mixed_precision:
            return None
        if self.ref_model is not None:
            return OneDNNLinears(self.ref_model)
        return OneDNNLinears(self.model, gradients=True)

    def _logprobs(
        self, model: torch.nn.Module, batch: PackedBatch, row: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``packed_logprobs`` of ``row`` under the learner's precision: with bfloat16-mixed the
        forward runs under bfloat16 autocast (tree mask in bfloat16), the log-probs in float32."""
        if not self.mixed_precision:
            with OneDNNLinears.active_if(self.onednn):
                return packed_logprobs(model, batch, row, self.temperature)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            return packed_logprobs(model, batch, row, self.temperature, torch.bfloat16)

    def state_dict(self) -> LearnerState:
        """What a checkpoint keeps: the trainable weights, optimizer, RNG states, counters."""
        if self.lora:
            from peft import get_peft_model_state_dict

            weights = get_peft_model_state_dict(self.model)
        else:
            weights = self.model.state_dict()
        counters = {
            "policy_version": self.version,
            "skipped_updates": self.skipped_updates,
            "skipped_in_a_row": self.skipped_in_a_row,
            "python_rng": self.rng.getstate(),
            "reward_norm": None if self.reward_norm is None else self.reward_norm.state_dict(),
        }
        return LearnerState(
            weights=weights,
            adapter=self.lora,
            optimizer=self.optimizer.state_dict(),
            torch_rng=torch.get_rng_state(),
            counters=counters,
        )

    def load_state_dict(self, state: LearnerState) -> None:
        """Continue exactly where the learner that wrote ``state`` stood."""
        if state.adapter != self.lora:
            raise UserInputError(
                f"the checkpoint holds {'a LoRA adapter' if state.adapter else 'full weights'} "
                f"but model.lora.enabled is {self.lora}; resume with the run's own config"
            )
        if self.lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, state.weights)
        else:
            self.model.load_state_dict(state.weights)
        self.optimizer.load_state_dict(state.optimizer)
        torch.set_rng_state(state.torch_rng)
        counters = state.counters
        self.rng.setstate(counters["python_rng"])
        self.version = counters["policy_version"]
        self.skipped_updates = counters["skipped_updates"]
        self.skipped_in_a_row = counters["skipped_in_a_row"]
        if self.reward_norm is not None:
            self.reward_norm.load_state_dict(counters["reward_norm"])

    def advantages(
        self, rewards: torch.Tensor, tree_ids: torch.Tensor, group_ids: torch.Tensor
    ) -> torch.Tensor:
        """Per-leaf advantages (L,) by ``ppo.advantage``; inputs (L,)."""
        if self.ppo.advantage == "chain":
            return chain_grpo_advantages(rewards, group_ids)
        return tree_grpo_advantages(rewards, tree_ids, group_ids)

    def update(self, trees: list[Tree]) -> dict[str, float]:
        """One PPO update (``epochs`` x ``minibatches`` optimizer steps) on a batch of trees."""
        metrics: dict[str, float] = tree_metrics(trees)
        with timed(metrics, "pack"):
            chunks = self._split(trees)
            batches = [
                pack_trees(chunk, self.ppo.micro_batch_tokens, self.tokenizer.pad_token_id)
                for chunk in chunks
            ]
            advantages = self._leaf_advantages(batches)
            routed = [r.to(self.device) for r in self._route(chunks, batches, advantages)]
            batches = [b.to(self.device) for b in batches]
        with timed(metrics, "ref_logprobs"):
            ref = [self._reference_logprobs(b) for b in batches]
        with timed(metrics, "old_logprobs"):
            old = [self._old_logprobs(b, len(batches)) for b in batches]
        stale = [self._stale_actions(b) for b in batches]
        metrics["learner/stale_token_frac"] = float(
            sum(0 if m is None else m.sum() for m in stale)
            / max(sum(float(b.loss_mask.sum()) for b in batches), 1.0)
        )
        minibatches = [
            Minibatch(*parts) for parts in zip(batches, routed, ref, old, stale, strict=True)
        ]
        steps = self.ppo.epochs * len(minibatches)
        with timed(metrics, "optimize"):
            for stats in self._optimize(minibatches):
                for key, value in stats.items():
                    metrics[key] = metrics.get(key, 0.0) + value / steps
        self._count_nonfinite(metrics)
        self.version += 1
        metrics["learner/policy_version"] = float(self.version)
        # each row is forwarded without its padding: every unique token once per forward, plus
        # the context repeated in the pieces of trees over ppo.micro_batch_tokens
        forwarded = float(sum(b.token_mask.sum() for b in batches))
        metrics["learner/split_trees"] = float(sum(b.split_trees for b in batches))
        metrics["learner/split_extra_tokens"] = float(sum(b.split_extra_tokens for b in batches))
        metrics["learner/tokens"] = forwarded - metrics["learner/split_extra_tokens"]
        metrics["learner/tokens_forwarded"] = forwarded
        metrics["learner/path_tokens"] = float(sum(b.path_tokens for b in batches))
        metrics["learner/advantage_abs_mean"] = float(advantages.abs().mean())
        metrics["learner/peak_rss_bytes"] = float(peak_rss_bytes())
        return metrics

    def _leaf_advantages(self, batches: list[PackedBatch]) -> torch.Tensor:
        """Advantages (L,) of the leaves of every batch, in order, from their (normalised)
        rewards."""
        rewards = torch.cat([b.rewards for b in batches])
        if self.reward_norm is not None:
            rewards = self.reward_norm(rewards, torch.cat([b.leaf_depths for b in batches]))
        return self.advantages(
            rewards,
            torch.cat([b.tree_ids for b in batches]),
            torch.cat([b.group_ids for b in batches]),
        )

    def _route(
        self, chunks: list[list[Tree]], batches: list[PackedBatch], advantages: torch.Tensor
    ) -> list[RoutedAdvantages]:
        """Each batch's share of ``advantages`` (L,) routed to its tokens; what each node got is
        kept in ``node_advantages``."""
        self.node_advantages = {}
        routed = []
        shares = advantages.split([len(b.rewards) for b in batches])
        for chunk, batch, share in zip(chunks, batches, shares, strict=True):
            nodes = batch.route_nodes(share, self.ppo.loss_mode, self.modifiers)
            self.node_advantages.update(node_advantages(chunk, share, nodes))
            routed.append(nodes.on_tokens(batch.token_node))
        return routed

    def _count_nonfinite(self, metrics: dict[str, float]) -> None:
        """An update with a non-finite loss or gradient in any step is counted as skipped (its
        bad steps changed nothing); ``NONFINITE_LIMIT`` skipped updates in a row stop the run."""
        skipped = metrics.pop("learner/nonfinite_steps") > 0
        self.skipped_updates += int(skipped)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        metrics["learner/skipped_updates"] = float(self.skipped_updates)
        if self.skipped_in_a_row >= NONFINITE_LIMIT:
            raise TrainingStopped(
                f"{NONFINITE_LIMIT} updates in a row had a non-finite loss or gradient (after "
                f"policy version {self.version}); lower ppo.lr or ppo.grad_clip, or check the "
                "rewards for NaN"
            )

    def _split(self, trees: list[Tree]) -> list[list[Tree]]:
        """``ppo.minibatches`` shuffled groups of whole trees (fewer when trees are fewer)."""
        order = list(trees)
        self.rng.shuffle(order)
        groups = [order[i :: self.ppo.minibatches] for i in range(self.ppo.minibatches)]
        return [group for group in groups if group]

    def _my_rows(self, batch: PackedBatch) -> list[int]:
        """The rows of ``batch`` this rank forwards (all of them without distribution)."""
        tokens = [batch.row_length(r) for r in range(batch.num_rows)]
        return deal_rows(tokens, self.world_size)[self.rank]

    @torch.no_grad()
    def _no_grad_logprobs(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        """Action-token log-probs (R, T) of ``model`` on this rank's rows of ``batch`` (0 on
        the other ranks' rows, which this rank never reads)."""
        out = torch.zeros(batch.input_ids.shape, device=batch.input_ids.device)
        for r in self._my_rows(batch):
            out[r] = self._logprobs(model, batch, r)[0]
        return out

    def _reference_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """Action-token log-probs (R, T) of the reference policy: the frozen copy, or with LoRA
        the same model with its adapter disabled."""
        if self.ref_model is not None:
            return self._no_grad_logprobs(self.ref_model, batch)
        with self.model.disable_adapter():
            return self._no_grad_logprobs(self.model, batch)

    def _old_logprobs(self, batch: PackedBatch, minibatches: int) -> torch.Tensor | None:
        """Log-probs (R, T) the ratio is taken against, or None when they are the current
        policy's own: with one optimizer step per update, recomputing them before the step gives
        exactly the training forward's values, so that forward is reused instead."""
        if self.ppo.use_engine_logprobs:
            return batch.behaviour_logprobs
        if self.ppo.epochs * minibatches == 1:
            return None
        return self._no_grad_logprobs(self.model, batch)

    def _stale_actions(self, batch: PackedBatch) -> torch.Tensor | None:
        """Action tokens sampled by a policy older than the current one, when the truncated
        importance correction applies to them (``ppo.is_cap`` > 0, ratios not taken against the
        engine's own log-probs); None when there are none."""
        if self.ppo.is_cap == 0 or self.ppo.use_engine_logprobs:
            return None
        stale = batch.stale_actions(self.version)
        return stale if bool(stale.any()) else None

    def _optimize(self, minibatches: list[Minibatch]) -> Iterator[dict[str, float]]:
        """Yield the statistics of each optimizer step: per epoch, every minibatch in a new
        order (``learner/nonfinite_steps`` 1 for a step skipped as non-finite)."""
        coef = PPOCoefficients.of(self.ppo)
        for _ in range(self.ppo.epochs):
            for mb in self.rng.sample(minibatches, len(minibatches)):
                stats = self._step(mb, coef)
                yield {"learner/nonfinite_steps": 1.0} if stats is None else stats

    def _step(self, mb: Minibatch, coef: PPOCoefficients) -> dict[str, float] | None:
        """One optimizer step on ``mb``: this rank's rows forwarded and back-propagated one at a
        time (gradient accumulation), gradients summed over the ranks. None, with the parameters
        unchanged on every rank, when a row's loss or the gradient norm is not finite."""
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {"learner/nonfinite_steps": 0.0}
        finite = True
        for r in self._my_rows(mb.batch):
            logprobs, entropy = self._logprobs(self.model, mb.batch, r)
            old = logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs[r]
            weights = None
            if mb.stale is not None:
                behaviour = mb.batch.behaviour_logprobs[r]
                weights = truncated_is_weights(old, behaviour, mb.stale[r], self.ppo.is_cap)
            loss, row_stats = routed_ppo_loss(
                logprobs,
                old,
                mb.ref_logprobs[r],
                entropy,
                mb.routed.row(r),
                mb.batch.loss_mask[r],
                mb.denominator,
                coef,
                weights,
            )
            finite = bool(torch.isfinite(loss))
            if not finite:
                break
            # activation checkpointing recomputes the forward here: on the forward's path
            with OneDNNLinears.active_if(self.onednn):
                loss.backward()
            row_stats["learner/loss"] = loss.item()
            for key, value in row_stats.items():
                stats[key] = stats.get(key, 0.0) + value
        if self.world_size > 1:  # every rank joins every collective, finite or not
            finite = all_agree(finite)
            sum_gradients(self.model.parameters())
            stats = sum_stats(stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ppo.grad_clip)
        if not (finite and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        return {**stats, "learner/grad_norm": float(grad_norm)}

    def policy_state(
        self, dtype: str = "float32", merge_lora: bool = False
    ) -> dict[str, torch.Tensor] | LoraPayload:
        """What rollout engines load: a detached CPU copy of the weights, or with LoRA only the
        adapter (its tensors and peft config) unless ``merge_lora`` asks for the base weights with
        the adapter added; floating tensors in the engine's ``dtype`` (bfloat16 halves what a
        bfloat16 engine is sent)."""
        cast = getattr(torch, dtype)

        def to_engine(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                k: v.detach().to("cpu", cast if v.is_floating_point() else v.dtype, copy=True)
                for k, v in tensors.items()
            }

        if not self.lora:
            return to_engine(self.model.state_dict())
        if merge_lora:
            return to_engine(merged_lora_state(self.model))
        from peft import get_peft_model_state_dict

        adapter = get_peft_model_state_dict(self.model)
        return LoraPayload(to_engine(adapter), self.model.peft_config["default"].to_dict())

    def engine_state(self, engine: EngineConfig) -> dict[str, torch.Tensor] | LoraPayload:
        """``policy_state`` as ``engine`` loads it: in its dtype, LoRA as adapters or merged."""
        return self.policy_state(engine.weights_dtype(), not engine.adapter_updates(self.lora))

    def save_trees(self, run_dir: Path, trees: list[Tree], metrics: dict[str, float]) -> Path:
        """Write the trees of the last update, with what it gave each node and its ``metrics``,
        to ``RUN/trees/step-NNNNNN.parquet`` (``treegrpo_ray.saved_trees``); returns the path."""
        meta = {
            "step": self.version,
            "advantage": self.ppo.advantage,
            "loss_mode": self.ppo.loss_mode,
            "metrics": metrics,
        }
        decode = cast(Decode, self.tokenizer.decode)  # one sequence of ids -> one string
        table = saved_trees_table(trees, self.node_advantages, decode, meta)
        return write_saved_trees(run_dir, self.version, table)

    def save(self, path: Path, extra: dict | None = None) -> Path:
        """Write the policy (safetensors + config), tokenizer and ``trainer_state.json``. With
        LoRA the policy is written merged (loadable as ``model.path``) and the adapter alone in
        ``adapter/``."""
        path.mkdir(parents=True, exist_ok=True)
        if self.lora:
            self.model.save_pretrained(path / "adapter")
            copy.deepcopy(self.model).merge_and_unload().save_pretrained(path)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        state = {"policy_version": self.version, **(extra or {})}
        (path / "trainer_state.json").write_text(json.dumps(state, indent=2))
        return path


def pull_batch(
    queue, groups_needed: int, version: int, max_lag: int, timeout_s: float | None = None
) -> tuple[list[Tree], dict]:
    """Take tree batches from the queue until ``groups_needed`` fresh prompt groups are in hand.
    A wait for one batch longer than ``timeout_s`` stops training (``TrainingStopped``).

    Trees generated by a policy older than ``version - max_lag`` are dropped and counted. The
    trees come back sorted by (group, tree), whatever order the workers finished in.
    Returns the trees and ``queue/...``, ``tree/...``, ``rollout/...`` and ``budget/...`` metrics.
    """
    trees: list[Tree] = []
    groups: set[int] = set()
    budget = Budget()
    metrics = {
        "queue/wait_s": 0.0,
        "tree/dropped_stale_groups": 0.0,
        "rollout/seconds": 0.0,
        "rollout/planner_seconds": 0.0,
    }
    staleness = 0
    while len(groups) < groups_needed:
        start = time.perf_counter()
        try:
            table = queue.get(timeout=timeout_s)
        except Empty as empty:  # queue.Empty, and Ray's Queue raises a subclass
            raise TrainingStopped(
                f"no trees arrived for {timeout_s:.0f} s (update {version + 1} had "
                f"{len(groups)} of {groups_needed} prompt groups): the rollouts stalled; "
                "`treegrpo logs` shows the controller's and workers' logs "
                "(train.queue_timeout_s sets the wait)"
            ) from empty
        metrics["queue/wait_s"] += time.perf_counter() - start
        info = batch_info(table)
        if info.policy_version < version - max_lag:
            metrics["tree/dropped_stale_groups"] += len(info.budgets)
            continue
        batch = trees_from_arrow(table)
        trees += batch
        staleness += (version - info.policy_version) * len(batch)
        groups.update(t.group_id for t in batch)
        for group_budget in info.budgets.values():
            budget.add(group_budget)
        metrics["rollout/seconds"] += info.rollout_seconds
        metrics["rollout/planner_seconds"] += info.planner_seconds
    metrics["tree/staleness"] = staleness / max(len(trees), 1)
    metrics.update(budget_metrics(budget, len(groups)))
    metrics.update(prefix_cache_metrics(budget))
    metrics["rollout/tokens_per_s"] = budget.generated_tokens / max(
        metrics["rollout/seconds"], 1e-9
    )
    return sorted(trees, key=lambda t: (t.group_id, t.tree_id)), metrics


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
    here = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
    restarted = ray.get(controller.register_learner.remote(learner.rank, here))
    latest = latest_checkpoint(cfg.run_dir / "checkpoints")
    if latest is not None:  # resumed or restarted: continue from the newest complete checkpoint
        learner.load_state_dict(load_checkpoint(latest))
    if first and (latest is not None or restarted):
        weights = ray.put(learner.engine_state(cfg.worker_engine()))
        ray.get(controller.restore.remote(learner.version, [weights]))
    cycle_start, publish_s = time.perf_counter(), 0.0
    while learner.version < cfg.train.steps:
        batch: Any = None
        if first:
            try:
                batch = pull_batch(
                    queue,
                    cfg.train.prompts_per_step,
                    learner.version,
                    cfg.train.max_policy_lag,
                    cfg.train.queue_timeout_s,
                )
            except TrainingStopped as err:
                batch = err
        if learner.world_size > 1:
            batch = broadcast_from_first(batch)
        if isinstance(batch, TrainingStopped):  # every rank stops; rank 0 keeps what it has
            if first:
                ray.get(controller.abort.remote(_save_last_good(learner, cfg, batch)))
            return
        trees, metrics = batch
        with timed(metrics, "update"):
            try:
                metrics.update(learner.update(trees))
            except (TrainingStopped, UserInputError) as err:  # raised alike on every rank
                if first:
                    ray.get(controller.abort.remote(_save_last_good(learner, cfg, err)))
                return
        if first:
            if should_save(cfg.train.save_trees_every, learner.version, cfg.train.steps):
                with timed(metrics, "save_trees"):
                    learner.save_trees(cfg.run_dir, trees, metrics)
            # idle: waiting for trees, and for the previous version's publish call (this cycle
            # runs from that call's start to this one's)
            metrics["timing/publish_wait_s"] = publish_s
            idle = metrics["queue/wait_s"] + publish_s
            metrics["learner/idle_frac"] = idle / (time.perf_counter() - cycle_start)
            cycle_start = time.perf_counter()
            weights = ray.put(learner.engine_state(cfg.worker_engine()))
            groups = sorted({t.group_id for t in trees})
            ray.get(controller.publish.remote(learner.version, [weights], metrics, groups))
            publish_s = time.perf_counter() - cycle_start
            every = cfg.train.checkpoint_every
            if every and learner.version % every == 0:
                try:
                    save_checkpoint(
                        learner.state_dict(), cfg.run_dir / "checkpoints", {"step": learner.version}
                    )
                except CheckpointNotWritten as err:
                    ray.get(controller.abort.remote(str(err)))
                    return
    report: dict[str, object] = {"policy_version": learner.version}
    if first:
        final = learner.save(cfg.run_dir / "checkpoint-final", extra={"step": learner.version})
        report["checkpoint_dir"] = str(final)
    ray.train.report(report)  # every worker reports, the same number of times
