"""The learning side: a plain ``Learner`` (PPO update on trees) and its Ray Train loop.

The ``Learner`` runs in-process in unit tests; ``train_loop_per_worker`` runs it inside a Ray Train
``TorchTrainer`` worker, pulling tree batches from the queue and publishing each new policy version
through the controller.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import torch

from treegrpo_ray.advantage import chain_grpo_advantages, tree_grpo_advantages
from treegrpo_ray.budget import Budget
from treegrpo_ray.config import PPOConfig
from treegrpo_ray.loss import ppo_loss
from treegrpo_ray.metrics import budget_metrics, timed, tree_metrics
from treegrpo_ray.modeling import load_policy
from treegrpo_ray.packing import PathBatch, expand_paths
from treegrpo_ray.tree import Tree, arrow_metadata, trees_from_arrow


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each next-token distribution.

    input_ids, attention_mask: (B, T). Returns ``(logprobs, entropy)``, both (B, T-1), under
    ``softmax(logits / temperature)`` (the distribution the rollout sampled from).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


class Learner:
    """Routed PPO on path-expanded trees with a frozen reference copy of the initial policy.

    temperature: the rollout temperature (log-probs are computed under the same distribution).
    advantage: ``tree`` (intra + inter, paper) or ``chain`` (prompt-level GRPO over all leaves).
    """

    def __init__(
        self,
        model_path: str,
        ppo: PPOConfig,
        temperature: float,
        advantage: str = "tree",
        seed: int = 0,
    ):
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_policy(model_path)
        self.model.train()
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=ppo.lr)
        self.ppo = ppo
        self.temperature = temperature
        self.advantage = advantage
        self.rng = random.Random(seed)
        self.version = 0

    def advantages(self, batch: PathBatch) -> torch.Tensor:
        """Per-leaf advantages (B,) by the configured estimator."""
        if self.advantage == "chain":
            return chain_grpo_advantages(batch.rewards, batch.group_ids)
        return tree_grpo_advantages(batch.rewards, batch.tree_ids, batch.group_ids)

    def update(self, trees: list[Tree]) -> dict[str, float]:
        """One PPO update (``epochs`` x ``minibatches`` optimizer steps) on a batch of trees."""
        metrics: dict[str, float] = tree_metrics(trees)
        with timed(metrics, "pack"):
            batch = expand_paths(trees, self.tokenizer.pad_token_id)
            advantages = self.advantages(batch)
        with timed(metrics, "ref_logprobs"), torch.no_grad():
            ref_logprobs, _ = token_logprobs(
                self.ref_model, batch.input_ids, batch.attention_mask, self.temperature
            )
        with timed(metrics, "old_logprobs"):
            old_logprobs = self._old_logprobs(batch)
        with timed(metrics, "optimize"):
            for stats in self._optimize(batch, advantages, old_logprobs, ref_logprobs):
                for key, value in stats.items():
                    metrics[key] = metrics.get(key, 0.0) + value / self._steps_per_update
        self.version += 1
        metrics["learner/policy_version"] = float(self.version)
        metrics["learner/tokens"] = float(batch.attention_mask.sum())
        metrics["learner/advantage_abs_mean"] = float(advantages.abs().mean())
        return metrics

    @property
    def _steps_per_update(self) -> int:
        return self.ppo.epochs * self.ppo.minibatches

    @torch.no_grad()
    def _old_logprobs(self, batch: PathBatch) -> torch.Tensor | None:
        """Log-probs (B, T-1) the ratio is taken against, or None when they are the current
        policy's own: with one optimizer step per update, recomputing them before the step gives
        exactly the training forward's values, so that forward is reused instead."""
        if self.ppo.use_engine_logprobs:
            return batch.behaviour_logprobs
        if self._steps_per_update == 1:
            return None
        logprobs, _ = token_logprobs(
            self.model, batch.input_ids, batch.attention_mask, self.temperature
        )
        return logprobs

    def _optimize(
        self,
        batch: PathBatch,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor,
    ):
        """Yield the statistics of each optimizer step over shuffled minibatches of rows."""
        coef = self.ppo.coefficients()
        for _ in range(self.ppo.epochs):
            order = list(range(len(batch)))
            self.rng.shuffle(order)
            for rows in torch.tensor(order).chunk(self.ppo.minibatches):
                mb = batch.select(rows)
                logprobs, entropy = token_logprobs(
                    self.model, mb.input_ids, mb.attention_mask, self.temperature
                )
                token_advantages = advantages[rows, None].expand_as(mb.loss_mask)
                loss, stats = ppo_loss(
                    logprobs,
                    logprobs.detach() if old_logprobs is None else old_logprobs[rows],
                    ref_logprobs[rows],
                    entropy,
                    token_advantages,
                    mb.loss_mask,
                    coef,
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.ppo.grad_clip
                )
                self.optimizer.step()
                yield {**stats, "learner/loss": loss.item(), "learner/grad_norm": float(grad_norm)}

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Detached CPU copy of the policy weights, as rollout engines load them."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def save(self, path: Path, extra: dict | None = None) -> Path:
        """Write the policy (safetensors + config), tokenizer and ``trainer_state.json``."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        state = {"policy_version": self.version, **(extra or {})}
        (path / "trainer_state.json").write_text(json.dumps(state, indent=2))
        return path


def pull_batch(queue, groups_needed: int, version: int, max_lag: int) -> tuple[list[Tree], dict]:
    """Take tree batches from the queue until ``groups_needed`` fresh prompt groups are in hand.

    Trees generated by a policy older than ``version - max_lag`` are dropped and counted.
    Returns the trees and ``queue/...``, ``rollout/...`` and ``budget/...`` metrics.
    """
    trees: list[Tree] = []
    groups: set[int] = set()
    budget = Budget()
    metrics = {"queue/wait_s": 0.0, "tree/dropped_stale": 0.0, "rollout/seconds": 0.0}
    while len(groups) < groups_needed:
        start = time.perf_counter()
        table = queue.get()
        metrics["queue/wait_s"] += time.perf_counter() - start
        meta = arrow_metadata(table)
        if meta["policy_version"] < version - max_lag:
            metrics["tree/dropped_stale"] += len(meta["budgets"])
            continue
        batch = trees_from_arrow(table)
        trees += batch
        groups.update(t.group_id for t in batch)
        for counts in meta["budgets"].values():
            budget.add(Budget(**counts))
        metrics["rollout/seconds"] += meta["rollout_seconds"]
    metrics.update(budget_metrics(budget, len(groups)))
    metrics["rollout/tokens_per_s"] = budget.generated_tokens / max(
        metrics["rollout/seconds"], 1e-9
    )
    return trees, metrics


def train_loop_per_worker(config: dict) -> None:
    """Ray Train worker: pull trees, update, publish each new version through the controller."""
    import ray
    import ray.train

    cfg = config["cfg"]
    controller = config["controller"]
    torch.set_num_threads(cfg.cluster.torch_threads)
    queue = ray.get(controller.get_queue.remote())
    learner = Learner(
        config["model_path"],
        cfg.ppo,
        temperature=cfg.sampling.temperature,
        advantage=cfg.ppo.advantage,
        seed=cfg.train.seed,
    )
    for _ in range(cfg.train.steps):
        trees, metrics = pull_batch(
            queue, cfg.train.prompts_per_step, learner.version, cfg.train.max_policy_lag
        )
        with timed(metrics, "update"):
            metrics.update(learner.update(trees))
        weights = ray.put(learner.policy_state())
        ray.get(controller.publish.remote(learner.version, [weights], metrics))
    final = learner.save(cfg.run_dir / "checkpoint-final", extra={"step": learner.version})
    ray.train.report({"policy_version": learner.version, "checkpoint_dir": str(final)})
