"""Turn trees into model inputs.

``expand_paths`` is the reference layout the paper's code trains on: one right-padded row per
root-to-leaf path (prompt + every node's action and observation tokens), with the loss on action
tokens only. Shared prefixes are repeated once per leaf below them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treegrpo_ray.tree import Tree


@dataclass
class PathBatch:
    """One row per leaf. T is the longest path; targets are ``input_ids[:, 1:]``.

    input_ids: (B, T) long, right-padded with ``pad_token_id``.
    attention_mask: (B, T) long, 1 on real tokens.
    loss_mask: (B, T-1) float, 1 where the target token is an action token.
    behaviour_logprobs: (B, T-1) float, the engine's log-prob of each action target (0 elsewhere).
    rewards, tree_ids, group_ids, policy_version: (B,) per leaf.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    rewards: torch.Tensor
    tree_ids: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> PathBatch:
        """The sub-batch of the given row indices (all fields indexed alike)."""
        return PathBatch(**{name: value[rows] for name, value in vars(self).items()})


def expand_paths(trees: list[Tree], pad_token_id: int) -> PathBatch:
    """Path-expanded batch of every leaf of ``trees``."""
    rows: list[tuple[list[int], list[float], list[float]]] = []
    leaf_info = []
    for tree in trees:
        for leaf in tree.leaves():
            ids, is_action, logprobs = (
                list(tree.prompt_ids),
                [0.0] * len(tree.prompt_ids),
                [0.0] * len(tree.prompt_ids),
            )
            for node in tree.path(leaf.node_id):
                ids += node.action_ids + node.obs_ids
                is_action += [1.0] * len(node.action_ids) + [0.0] * len(node.obs_ids)
                logprobs += list(node.action_logprobs) + [0.0] * len(node.obs_ids)
            rows.append((ids, is_action, logprobs))
            leaf_info.append((leaf.reward, tree.tree_id, tree.group_id, leaf.policy_version))
    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width))
    behaviour = torch.zeros((len(rows), width))
    for i, (ids, is_action, logprobs) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(is_action)
        behaviour[i, : len(ids)] = torch.tensor(logprobs)
    rewards, tree_ids, group_ids, versions = zip(*leaf_info, strict=True)
    return PathBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask[:, 1:],
        behaviour_logprobs=behaviour[:, 1:],
        rewards=torch.tensor(rewards, dtype=torch.float32),
        tree_ids=torch.tensor(tree_ids),
        group_ids=torch.tensor(group_ids),
        policy_version=torch.tensor(versions),
    )
