"""The plain ``Learner``: the PPO update on trees (packed, advantages routed to nodes), its
optimizer, reference policy, checkpoints and the weights it ships to the engines. It runs
in-process (tests, ``LocalRun``) and inside a Ray Train worker (``learners/loop.py``)."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from treegrpo_ray.advantage import RoutedAdvantages, chain_grpo_advantages, tree_grpo_advantages
from treegrpo_ray.config import EngineConfig, JobConfig, LoraSettings, PPOConfig
from treegrpo_ray.engine import LoraPayload
from treegrpo_ray.errors import TrainingStopped, UserInputError
from treegrpo_ray.learners.checkpoint import LearnerCounters, LearnerState
from treegrpo_ray.learners.distributed import (
    all_agree,
    deal_rows,
    sum_gradients,
    sum_stats,
    world,
)
from treegrpo_ray.learners.forward import (
    Policy,
    attention_implementation,
    compile_decoder_layers,
    packed_logprobs,
)
from treegrpo_ray.loss import PPOCoefficients, routed_ppo_loss, truncated_is_weights
from treegrpo_ray.metrics import (
    peak_rss_bytes,
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
    write_saved_trees,
)
from treegrpo_ray.stops import Decode
from treegrpo_ray.tree import Tree

if TYPE_CHECKING:
    pass


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
    ref_logprobs: torch.Tensor | None  # None: no KL term (ppo.uses_reference())
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
        self.reference = ppo.uses_reference()
        self.ref_model: torch.nn.Module | None = None
        if lora is not None and lora.enabled:
            self.model = with_lora_adapter(self.model, lora)
        elif self.reference:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if ppo.compile_layers:
            compile_decoder_layers(self.model)
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
        if self.lora:
            return OneDNNLinears(self.model, gradients=True)
        return None if self.ref_model is None else OneDNNLinears(self.ref_model)

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
        counters = LearnerCounters(
            policy_version=self.version,
            skipped_updates=self.skipped_updates,
            skipped_in_a_row=self.skipped_in_a_row,
            python_rng=self.rng.getstate(),
            reward_norm=None if self.reward_norm is None else self.reward_norm.state_dict(),
        )
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
        self.rng.setstate(counters.python_rng)
        self.version = counters.policy_version
        self.skipped_updates = counters.skipped_updates
        self.skipped_in_a_row = counters.skipped_in_a_row
        if self.reward_norm is not None:
            self.reward_norm.load_state_dict(counters.reward_norm)

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
                pack_trees(
                    chunk,
                    self.ppo.micro_batch_tokens,
                    self.tokenizer.pad_token_id,
                    one_tree_per_row=self.ppo.trees_per_row == "one",
                )
                for chunk in chunks
            ]
            advantages = self._leaf_advantages(batches)
            routed = [r.to(self.device) for r in self._route(chunks, batches, advantages)]
            batches = [b.to(self.device) for b in batches]
        with timed(metrics, "ref_logprobs"):
            ref = [self._reference_logprobs(b) if self.reference else None for b in batches]
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
                None if mb.ref_logprobs is None else mb.ref_logprobs[r],
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
