import math

import torch

from treegrpo_ray.packing import expand_paths
from treegrpo_ray.tree import ROOT, Tree


def _tree():
    # prompt [1, 2]; root -> a (search: action [3, 4], obs [5]) -> b (answer: action [6], leaf)
    #                         -> c (answer: action [7, 8], leaf)
    tree = Tree(tree_id=0, group_id=0, prompt_ids=[1, 2])
    common = dict(policy_version=0, role="search", tool_call=False, finish_reason="stop")
    tree.add(
        ROOT, action_ids=[3, 4], action_logprobs=[-0.1, -0.2], obs_ids=[5], finished=False, **common
    )
    tree.add(
        0, action_ids=[6], action_logprobs=[-0.3], obs_ids=[], finished=True, reward=1.0, **common
    )
    tree.add(
        ROOT,
        action_ids=[7, 8],
        action_logprobs=[-0.4, -0.5],
        obs_ids=[],
        finished=True,
        reward=0.2,
        **common,
    )
    return tree


def test_expand_paths_builds_one_row_per_leaf_with_action_only_loss():
    batch = expand_paths([_tree()], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    # targets are input_ids[:, 1:]: [2, 3, 4, 5, 6] and [2, 7, 8, pad, pad]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]]
    expected = torch.tensor([[0, -0.1, -0.2, 0, -0.3], [0, -0.4, -0.5, 0, 0]])
    torch.testing.assert_close(batch.behaviour_logprobs, expected)
    torch.testing.assert_close(batch.rewards, torch.tensor([1.0, 0.2]))
    assert batch.tree_ids.tolist() == [0, 0]


def test_select_keeps_rows_aligned():
    batch = expand_paths([_tree()], pad_token_id=0)
    sub = batch.select(torch.tensor([1]))
    assert sub.input_ids.tolist() == [[1, 2, 7, 8, 0, 0]]
    assert math.isclose(float(sub.rewards[0]), 0.2, rel_tol=1e-6)
