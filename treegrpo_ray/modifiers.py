"""Per-node modifiers of the routed loss and per-depth reward normalisation (all off by default).

A node's depth d is ``AgentStep.depth`` (0 for the root's children, the first agent step) and its
role is ``AgentStep.role`` (``search``, ``answer``, ``truncated``...). With s = w(d), β_n and η_n
the node's KL and entropy coefficients, a token t of node n with routing weight w_t adds

    s · Σ_k pg(ρ_t, A_k,t) + s · β_n · w_t · KL_t - s · η_n · w_t · H_t

to the loss, divided by the token-mean denominator ``sum(loss_mask · weights)`` (see
``loss.routed_ppo_loss``):

- depth decay: ``w(d) = first · per_level^d`` (``first`` on the first level, ×``per_level`` per
  level below), applied as ``s · A`` (the dual-clipped pg term is positively homogeneous in A).
  The denominator is not decayed, so a decay below 1 shrinks those tokens' share of the loss.
- per-role KL / entropy coefficients: β_n, η_n are the role's entry of ``role_kl_coef`` /
  ``role_entropy_coef`` where there is one, ``ppo.kl_coef`` / ``ppo.entropy_coef`` otherwise.
- frozen roles: a node whose role is frozen gets advantages, leaf counts and weight 0, i.e. its
  tokens are out of the loss (as with loss_mask 0) and out of the denominator, so the other tokens'
  loss stays a proper token-mean.

``DepthRewardNorm`` normalises leaf rewards per leaf depth with running statistics before the
advantages are computed; its state belongs in a checkpoint (``state_dict``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from treegrpo_ray.advantage import EPS, RoutedAdvantages
from treegrpo_ray.config import ModifiersConfig


@dataclass(frozen=True)
class DepthDecay:
    """Node weight multiplier ``w(d) = first · per_level^d`` over node depths d (0 = first step)."""

    first: float
    per_level: float

    def __call__(self, depths: torch.Tensor) -> torch.Tensor:
        """depths: (N,) long. Returns w (N,) float32."""
        return (self.first * self.per_level ** depths.double()).float()


@dataclass(frozen=True)
class NodeModifiers:
    """What the per-node modifiers change (formulas in the module docstring).

    kl_coef, entropy_coef: the run's coefficients, for roles without an override.
    depth_decay: None leaves every node's weight as routed.
    role_kl_coef, role_entropy_coef: role -> coefficient that replaces kl_coef / entropy_coef.
    frozen_roles: roles whose tokens are out of the loss.
    """

    kl_coef: float
    entropy_coef: float
    depth_decay: DepthDecay | None = None
    role_kl_coef: Mapping[str, float] = field(default_factory=dict)
    role_entropy_coef: Mapping[str, float] = field(default_factory=dict)
    frozen_roles: frozenset[str] = frozenset()

    def apply(
        self, nodes: RoutedAdvantages, depths: torch.Tensor, roles: Sequence[str]
    ) -> RoutedAdvantages:
        """The node routing (advantages, leaves (K, N), weights (N,)) with the modifiers applied
        and the nodes' KL and entropy coefficients (N,) set, each already times w(d).

        depths: (N,) long; roles: N role names, in the order of the nodes.
        """
        scale = torch.ones(len(roles)) if self.depth_decay is None else self.depth_decay(depths)
        trainable = torch.tensor([role not in self.frozen_roles for role in roles]).float()
        kl = torch.tensor([self.role_kl_coef.get(role, self.kl_coef) for role in roles])
        ent = torch.tensor([self.role_entropy_coef.get(role, self.entropy_coef) for role in roles])
        return RoutedAdvantages(
            advantages=nodes.advantages * scale * trainable,
            leaves=nodes.leaves * trainable,
            weights=nodes.weights * trainable,
            kl_coef=kl * scale,
            entropy_coef=ent * scale,
        )


class DepthRewardNorm:
    """Running mean and variance of leaf rewards per leaf depth, to normalise the rewards of each
    update before its advantages are computed.

    The statistics are exponential moving averages over updates with ``momentum`` m. The leaves of
    one update at depth d (mean b, population variance v of their rewards) move them as

        μ_d ← m·μ_d + (1 - m)·b
        σ²_d ← m·σ²_d + (1 - m)·v + m·(1 - m)·(b - μ_d,old)²

    (the moving averages of the first and second moments); the first update that sees depth d
    sets ``μ_d = b, σ²_d = v``. Then each reward becomes ``(R - μ_d) / (σ_d + 1e-6)`` with the
    updated statistics. Every update weighs the same, however many leaves it has at a depth.
    Non-finite rewards do not move the statistics (and stay non-finite).
    """

    def __init__(self, momentum: float):
        self.momentum = momentum
        self.mean: dict[int, float] = {}
        self.var: dict[int, float] = {}

    def __call__(self, rewards: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """Update the statistics with this update's leaves and normalise their rewards.

        rewards: (L,) float; depths: (L,) long, each leaf's node depth. Returns (L,).
        """
        out = torch.empty_like(rewards)
        for depth in torch.unique(depths).tolist():
            at = depths == depth
            self._update(depth, rewards[at].double())
            mean, var = self.mean.get(depth, math.nan), self.var.get(depth, math.nan)
            out[at] = (rewards[at] - mean) / (var**0.5 + EPS)
        return out

    def _update(self, depth: int, rewards: torch.Tensor) -> None:
        """Move depth ``depth``'s statistics by ``rewards`` (n,); non-finite rewards are left out
        (they would spoil the statistics of every later update)."""
        rewards = rewards[rewards.isfinite()]
        if not len(rewards):
            return
        batch_mean, batch_var = float(rewards.mean()), float(rewards.var(correction=0))
        if depth not in self.mean:
            self.mean[depth], self.var[depth] = batch_mean, batch_var
            return
        m, old = self.momentum, self.mean[depth]
        self.mean[depth] = m * old + (1 - m) * batch_mean
        self.var[depth] = (
            m * self.var[depth] + (1 - m) * batch_var + m * (1 - m) * (batch_mean - old) ** 2
        )

    def state_dict(self) -> dict[str, list]:
        """The statistics as plain lists (JSON-serialisable): depths, mean, var."""
        depths = sorted(self.mean)
        return {
            "depths": depths,
            "mean": [self.mean[d] for d in depths],
            "var": [self.var[d] for d in depths],
        }

    def load_state_dict(self, state: Mapping[str, list]) -> None:
        """Restore what ``state_dict`` returned."""
        depths = [int(d) for d in state["depths"]]
        self.mean = dict(zip(depths, map(float, state["mean"]), strict=True))
        self.var = dict(zip(depths, map(float, state["var"]), strict=True))


def node_modifiers(
    cfg: ModifiersConfig, kl_coef: float, entropy_coef: float
) -> NodeModifiers | None:
    """The per-node modifiers of ``ppo.modifiers`` over the run's coefficients; None when all are
    off."""
    if not (cfg.depth_decay or cfg.role_kl_coef or cfg.role_entropy_coef or cfg.frozen_roles):
        return None
    decay = cfg.depth_decay
    return NodeModifiers(
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        depth_decay=None if decay is None else DepthDecay(decay.first, decay.per_level),
        role_kl_coef=dict(cfg.role_kl_coef),
        role_entropy_coef=dict(cfg.role_entropy_coef),
        frozen_roles=frozenset(cfg.frozen_roles),
    )


def reward_normalizer(cfg: ModifiersConfig) -> DepthRewardNorm | None:
    """A fresh per-depth reward normaliser of ``ppo.modifiers``; None when off."""
    if cfg.reward_norm_momentum is None:
        return None
    return DepthRewardNorm(cfg.reward_norm_momentum)
