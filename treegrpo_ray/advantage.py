"""Group-relative advantages over leaves: chain GRPO and Tree-GRPO (paper Eq. 6-8).

Tree-GRPO: ``A = (R - mean_tree) / (std_tree + eps) + (R - mean_prompt) / (std_prompt + eps)``.
Statistics use the unbiased std (``torch.std`` default) and ``eps = 1e-6`` as the reference code,
computed in float64 on rewards shifted by the group's first reward: the result is the same, but a
group of equal rewards gets exactly 0 at any size (in float32 the mean of n >= 7 copies of 0.8 is one
rounding step off, and dividing by ``std + eps`` with std ~1e-8 turned that into -0.06).
A group with a single leaf contributes 0 (deliberate deviation: the paper's code uses mean 0 / std 1,
i.e. the raw reward; with 0 a one-leaf tree adds nothing and Tree-GRPO with N = 0 equals chain GRPO).

``route_to_nodes`` hands the leaf advantages to the nodes above them, for the routed per-node loss
of packed trees (``loss.routed_ppo_loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

EPS = 1e-6


def group_normalized(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """``(R - mean_g) / (std_g + eps)`` within each group; 0 for singleton groups.

    rewards: (L,) float; group_ids: (L,) int. Returns (L,).
    """
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for group in torch.unique(group_ids):
        members = group_ids == group
        if int(members.sum()) < 2:
            continue
        r = rewards[members].double()
        shifted = r - r[0]  # exact zeros for equal rewards; mean and std are shift-invariant
        out[members] = (shifted - shifted.mean()) / (shifted.std() + eps)
    return out.to(rewards.dtype)


def chain_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO: normalise each leaf's reward within its prompt group. (L,) -> (L,)."""
    return group_normalized(rewards, group_ids)


def tree_grpo_advantages(
    rewards: torch.Tensor, tree_ids: torch.Tensor, group_ids: torch.Tensor
) -> torch.Tensor:
    """Tree-GRPO: intra-tree plus inter-tree (prompt-level) normalised rewards.

    rewards, tree_ids, group_ids: (L,) over the leaves of a batch. Returns (L,).
    """
    return group_normalized(rewards, tree_ids) + group_normalized(rewards, group_ids)


@dataclass
class RoutedAdvantages:
    """Leaf advantages routed to nodes (``(..., N)``) or to packed tokens (``(..., R, T)``).

    advantages: (K, ...) the K advantage parts each token's loss is summed over.
    leaves: (K, ...) how many leaves stand behind each part (they weigh the clip fraction).
    weights: (...) how many times the token counts in the token-mean (KL, entropy, denominator).

    ``paper`` mode: K = 2, the positive mass ``sum(max(A, 0))`` and the negative mass
    ``sum(min(A, 0))`` over the leaves below the node, with the counts of positive and negative
    leaves, and weight = number of leaves below. The dual-clipped PPO term is positively
    homogeneous in A on each sign (``pg(ρ, a·A) = a·pg(ρ, A)`` for ``a >= 0``), so the sum of
    ``pg(ρ, A_leaf)`` over the leaves below equals ``pg(ρ, positive) + pg(ρ, negative)``: with this
    routing the packed loss equals the path-expanded one exactly.
    ``mean`` mode: K = 1, the mean advantage of the leaves below, weight 1 (0 for a node with no
    leaf below, which no path holds).

    kl_coef, entropy_coef: (...) each token's own KL and entropy coefficient, set by per-node
    modifiers (``modifiers.NodeModifiers``); None: ``PPOCoefficients``' for every token.
    """

    advantages: torch.Tensor
    leaves: torch.Tensor
    weights: torch.Tensor
    kl_coef: torch.Tensor | None = None
    entropy_coef: torch.Tensor | None = None

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RoutedAdvantages:
        """``fn`` applied to every tensor field, along the trailing (node or token) dimensions."""
        fields: dict[str, Any] = {
            name: None if value is None else fn(value) for name, value in vars(self).items()
        }
        return RoutedAdvantages(**fields)

    def to(self, device: torch.device) -> RoutedAdvantages:
        """The same routing with every tensor on ``device``."""
        return self._map(lambda value: value.to(device))

    def row(self, row: int) -> RoutedAdvantages:
        """One packed row of a token-level routing: (K, T), (K, T), (T,)."""
        return self._map(lambda value: value[..., row, :])

    def on_tokens(self, token_node: torch.Tensor) -> RoutedAdvantages:
        """A node routing gathered onto packed tokens: ``token_node`` (R, T) holds each token's
        node, -1 on prompt and padding tokens, which get 0."""
        on_node = token_node >= 0
        index = token_node.clamp(min=0)
        return self._map(lambda value: value[..., index] * on_node)


def route_to_nodes(
    leaf_advantages: torch.Tensor, node_leaves: torch.Tensor, mode: Literal["paper", "mean"]
) -> RoutedAdvantages:
    """Per-node advantage parts (see ``RoutedAdvantages``).

    leaf_advantages: (L,); node_leaves: (N, L), 1 where leaf l is node n or lies below it.
    Returns advantages and leaves (K, N), weights (N,).
    """
    below = node_leaves.sum(-1)
    if mode == "paper":
        signs = torch.stack([leaf_advantages > 0, leaf_advantages < 0]).float()
        return RoutedAdvantages(
            advantages=(signs * leaf_advantages) @ node_leaves.T,
            leaves=signs @ node_leaves.T,
            weights=below,
        )
    on_a_path = (below > 0).float()
    return RoutedAdvantages(
        advantages=(node_leaves @ leaf_advantages / below.clamp(min=1))[None],
        leaves=on_a_path[None],
        weights=on_a_path,
    )
