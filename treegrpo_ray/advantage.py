"""Group-relative advantages over leaves: chain GRPO and Tree-GRPO (paper Eq. 6-8).

Tree-GRPO: ``A = (R - mean_tree) / (std_tree + eps) + (R - mean_prompt) / (std_prompt + eps)``.
Statistics use the unbiased std (``torch.std`` default) and ``eps = 1e-6`` as the reference code.
A group with a single leaf contributes 0 (deliberate deviation: the paper's code uses mean 0 / std 1,
i.e. the raw reward; with 0 a one-leaf tree adds nothing and Tree-GRPO with N = 0 equals chain GRPO).
"""

from __future__ import annotations

import torch

EPS = 1e-6


def group_normalized(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """``(R - mean_g) / (std_g + eps)`` within each group; 0 for singleton groups.

    rewards: (L,) float; group_ids: (L,) int. Returns (L,).
    """
    out = torch.zeros_like(rewards)
    for group in torch.unique(group_ids):
        members = group_ids == group
        if int(members.sum()) < 2:
            continue
        r = rewards[members]
        out[members] = (r - r.mean()) / (r.std() + eps)
    return out


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
