import pytest
import torch

from treegrpo_ray.advantage import chain_grpo_advantages, group_normalized, tree_grpo_advantages


def test_tree_grpo_matches_hand_computed_values():
    # Two trees of one prompt, three leaves each.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    tree_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    group_ids = torch.zeros(6, dtype=torch.long)
    # tree 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2(1/3)^2) / 2) = sqrt(1/3) = 0.577350
    #   intra: 1 -> (2/3)/0.577350 = 1.154701, 0 -> (-1/3)/0.577350 = -0.577350
    # tree 1: mean 2/3, same std: 1 -> 0.577350, 0 -> -1.154701
    # prompt: mean 1/2, unbiased std sqrt(6 * 0.25 / 5) = 0.547723: 1 -> 0.912871, 0 -> -0.912871
    expected = torch.tensor(
        [
            1.154701 + 0.912871,
            -0.577350 - 0.912871,
            -0.577350 - 0.912871,
            0.577350 + 0.912871,
            0.577350 + 0.912871,
            -1.154701 - 0.912871,
        ]
    )
    got = tree_grpo_advantages(rewards, tree_ids, group_ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_eps_is_added_to_the_unbiased_std():
    # Two leaves 0 and 1: mean 0.5, unbiased std sqrt(0.5) = 0.707107; (1 - 0.5) / (0.707107 + 1e-6)
    got = group_normalized(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), eps=1e-6)
    expected = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(got, torch.tensor([-expected, expected]), atol=1e-7, rtol=0)


def test_singleton_and_constant_groups_give_zero():
    rewards = torch.tensor([0.8, 0.2, 0.2, 0.5])
    group_ids = torch.tensor([0, 1, 1, 2])  # group 0 and 2 are singletons, group 1 constant
    assert torch.equal(group_normalized(rewards, group_ids), torch.zeros(4))


@pytest.mark.parametrize(
    ("reward", "size"),
    # float32 used to give -0.056, -0.106, -0.0147, -0.0147, -0.0074 for the first five
    [(0.8, 8), (0.8, 12), (0.2, 8), (0.2, 16), (0.1, 16), (1.0, 16), (0.3, 7), (0.7, 64)],
)
def test_equal_rewards_give_exactly_zero_at_any_group_size(reward, size):
    rewards = torch.full((size,), reward)
    group_ids = torch.zeros(size, dtype=torch.long)
    assert torch.equal(chain_grpo_advantages(rewards, group_ids), torch.zeros(size))
    tree_ids = torch.arange(size) // 4  # trees of 4 leaves (and a remainder) under one prompt
    assert torch.equal(tree_grpo_advantages(rewards, tree_ids, group_ids), torch.zeros(size))


def test_a_large_group_keeps_its_hand_computed_values():
    # 15 leaves of 0.2 and one of 1.0: mean 0.25, deviations -0.05 (x15) and 0.75,
    # unbiased std sqrt((15 * 0.0025 + 0.5625) / 15) = sqrt(0.04) = 0.2
    rewards = torch.tensor([0.2] * 15 + [1.0])
    got = chain_grpo_advantages(rewards, torch.zeros(16, dtype=torch.long))
    expected = torch.tensor([-0.05 / (0.2 + 1e-6)] * 15 + [0.75 / (0.2 + 1e-6)])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_one_leaf_trees_reduce_tree_grpo_to_chain_grpo():
    # N = 0: every tree is one chain, so the intra-tree term vanishes.
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=generator)
    group_ids = torch.arange(12) // 4
    tree_ids = torch.arange(12)
    torch.testing.assert_close(
        tree_grpo_advantages(rewards, tree_ids, group_ids),
        chain_grpo_advantages(rewards, group_ids),
        atol=0,
        rtol=0,
    )
