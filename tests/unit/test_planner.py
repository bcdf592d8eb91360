"""The planner's selection rules and budget allocation on hand-built trees, with the scores
computed by hand, and the uniform rule against the planner as it was before them."""

from __future__ import annotations

import math
import random

import pytest

from treegrpo_ray.planner import (
    Selection,
    TreePlanner,
    TreeShape,
    adaptive_counts,
    branch_gains,
    disagreement_ratio,
    node_stats,
)
from treegrpo_ray.tree import ROOT, Tree


def step(entropy: float = 0.5, tokens: int = 2, reward: float | None = None) -> dict:
    """Fields of one node: an action of ``tokens`` tokens with mean entropy ``entropy``; a leaf
    with ``reward`` when given."""
    leaf = reward is not None
    return dict(
        action_ids=[7] * tokens,
        action_logprobs=[-1.0] * tokens,
        obs_ids=[] if leaf else [9],
        finished=leaf,
        finish_reason="done" if leaf else "stop",
        policy_version=0,
        role="answer" if leaf else "search",
        tool_call=not leaf,
        reward=reward if leaf else math.nan,
        entropy=entropy,
    )


def chain(tree: Tree, parent: int, entropies: list[float], reward: float) -> None:
    """A branch from ``parent``: one node per entropy, the last a leaf with ``reward``."""
    for entropy in entropies[:-1]:
        parent = tree.add(parent, **step(entropy)).node_id
    tree.add(parent, **step(entropies[-1], reward=reward))


def random_tree(rng: random.Random, tree_id: int, group_id: int) -> Tree:
    """A tree grown like a rollout: a chain, then branches from random expandable nodes."""
    tree = Tree(tree_id, group_id, [1, 2])
    for _ in range(rng.randint(1, 4)):
        parent = rng.choice(tree.expandable())
        depth = rng.randint(1, 3)
        chain(tree, parent, [rng.random() for _ in range(depth)], rng.choice([0.0, 0.2, 1.0]))
    return tree


def planner_before_selection_rules(trees: list[Tree], n: int, rng: random.Random) -> list:
    """``TreePlanner.next_round`` as it was before ``tree.select`` existed."""
    expansions = []
    for i, tree in enumerate(trees):
        candidates = tree.expandable()
        expansions += [(i, rng.choice(candidates)) for _ in range(n)]
    return expansions


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("n", [1, 2, 5])
def test_uniform_picks_what_the_planner_picked_before_seed_for_seed(seed, n):
    trees = [random_tree(random.Random(1000 * seed + t), t, t // 2) for t in range(6)]
    old_rng, new_rng = random.Random(seed), random.Random(seed)
    expected = planner_before_selection_rules(trees, n, old_rng)
    planner = TreePlanner(TreeShape(m=2, n=n, l=1), new_rng, Selection("uniform", allocate="fixed"))
    got = planner.next_round(trees)
    assert [(e.tree_index, e.node_id) for e in got] == expected
    assert new_rng.getstate() == old_rng.getstate()  # the same RNG calls, so later ones match too
    assert all(e.score == 1 / len(trees[e.tree_index].expandable()) for e in got)


def entropy_tree() -> Tree:
    # ROOT -> 0 (H 0.5) -> 1 (H 1.2) -> 2 (leaf, H 0.9, R 0.2)
    #      -> 3 (H 0.7) -> 4 (leaf, H 0.3, R 1.0)
    tree = Tree(0, 0, [1, 2])
    chain(tree, ROOT, [0.5, 1.2, 0.9], 0.2)
    chain(tree, ROOT, [0.7, 0.3], 1.0)
    return tree


def test_entropy_rule_takes_the_distinct_nodes_with_the_highest_next_action_entropy():
    tree = entropy_tree()
    # next-action entropy - 0.05 x (branches - 1):
    #   ROOT: mean(0.5, 0.7) = 0.6 - 0.05 x 1 = 0.55;  0: 1.2;  1: 0.9;  3: 0.3
    planner = TreePlanner(TreeShape(1, 3, 1), random.Random(0), Selection("entropy"))
    picks = planner.next_round([tree])
    assert [e.node_id for e in picks] == [0, 1, ROOT]
    assert [e.score for e in picks] == pytest.approx([1.2, 0.9, 0.55])
    assert picks[2].reason == "entropy: next-action H 0.600 - 0.05 x 1 siblings"
    # more picks than candidates: each once, in score order, then again from the top
    planner = TreePlanner(TreeShape(1, 6, 1), random.Random(0), Selection("entropy"))
    assert [e.node_id for e in planner.next_round([tree])] == [0, 1, ROOT, 3, 0, 1]
    # a larger sibling penalty moves the root below node 3: 0.6 - 0.4 = 0.2 < 0.3
    planner = TreePlanner(TreeShape(1, 4, 1), random.Random(0), Selection("entropy", 0.4))
    assert [e.node_id for e in planner.next_round([tree])] == [0, 1, 3, ROOT]


def uncertainty_trees() -> list[Tree]:
    # One prompt, two trees; leaves 1.0, 0.0, 0.0: prompt mean 1/3.
    # A: ROOT -> 0 (H 0.5, 2 tokens) -> 1 (leaf, H 0.4, 2 tokens, R 1.0)
    #         -> 2 (leaf, H 0.25, 4 tokens, R 0.0)
    # B: ROOT -> 0 (leaf, R 0.0)
    a = Tree(0, 0, [1, 2])
    chain(a, ROOT, [0.5, 0.4], 1.0)
    a.add(ROOT, **step(0.25, tokens=4, reward=0.0))
    b = Tree(1, 0, [1, 2])
    chain(b, ROOT, [0.5], 0.0)
    return [a, b]


def test_node_stats_of_a_hand_built_tree():
    stats = node_stats(uncertainty_trees()[0])
    assert sorted(stats) == [ROOT, 0]
    root, zero = stats[ROOT], stats[0]
    assert (root.branches, root.leaves, root.reward_sum) == (2, 2, 1.0)
    assert root.next_entropy == pytest.approx((0.5 + 0.25) / 2)
    # every action below the root: (0.5 x 2 + 0.4 x 2 + 0.25 x 4) / 8 tokens = 2.8 / 8
    assert root.subtree_entropy == pytest.approx(0.35)
    assert (zero.branches, zero.leaves, zero.reward_sum) == (1, 1, 1.0)
    assert (zero.next_entropy, zero.subtree_entropy) == pytest.approx((0.4, 0.4))


def test_uncertainty_rule_adds_outcome_exploration_and_entropy_terms():
    trees = uncertainty_trees()
    sel = Selection("uncertainty", exploration=1.0, entropy_weight=0.5, prior_strength=1.0)
    picks = TreePlanner(TreeShape(2, 3, 1), random.Random(0), sel).next_round(trees)
    # Tree A, kappa 1, prompt mean 1/3, B = leaves of the tree + earlier picks:
    # ROOT: mu = (1 + 1/3) / 3 = 4/9, outcome sqrt(4/9 * 5/9 / 4) = 0.248452,
    #       entropy 0.5 x 0.35 = 0.175, explore sqrt(ln(1 + B) / 2) (2 branches)
    # 0:    mu = (1 + 1/3) / 2 = 2/3, outcome sqrt(2/3 * 1/3 / 3) = 0.272166,
    #       entropy 0.5 x 0.4 = 0.2, explore sqrt(ln(1 + B) / (1 + times picked))
    # pick 1 (B 2): ROOT 0.248452 + 0.741166 + 0.175 = 1.164618; 0: 0.272166 + 1.048147 + 0.2
    #               = 1.520313 -> 0
    # pick 2 (B 3): ROOT 0.248452 + 0.832555 + 0.175 = 1.256007; 0: 0.272166 + 0.832555 + 0.2
    #               = 1.304721 -> 0
    # pick 3 (B 4): ROOT 0.248452 + 0.897061 + 0.175 = 1.320513; 0: 0.272166 + 0.732447 + 0.2
    #               = 1.204613 -> ROOT
    in_a = [e for e in picks if e.tree_index == 0]
    assert [e.node_id for e in in_a] == [0, 0, ROOT]
    assert [e.score for e in in_a] == pytest.approx([1.520313, 1.304721, 1.320513], abs=1e-6)
    assert in_a[0].reason == "uncertainty: outcome sd 0.272 + explore 1.048 + entropy 0.5 x 0.400"
    # tree B has one candidate, its root
    assert [e.node_id for e in picks if e.tree_index == 1] == [ROOT] * 3


def allocation_batch() -> list[Tree]:
    """Four prompts of two one-chain trees each: leaves (0.2, 0.2), (1.0, 0.2), (1.0, 1.0),
    (0.2, 0.2)."""
    rewards = [(0.2, 0.2), (1.0, 0.2), (1.0, 1.0), (0.2, 0.2)]
    trees = []
    for group, pair in enumerate(rewards):
        for j, reward in enumerate(pair):
            tree = Tree(2 * group + j, group, [1, 2])
            chain(tree, ROOT, [0.5, 0.5], reward)
            trees.append(tree)
    return trees


def test_disagreement_ratio_compares_prompts_with_independent_draws_from_the_batch():
    # shares 0.2: 5/8, 1.0: 3/8; two leaves disagree with chance 1 - (5/8)^2 - (3/8)^2 = 0.46875,
    # so 4 prompts would have 1.875 mixed; 1 has: 1 / 1.875 = 8/15
    groups = [[0.2, 0.2], [1.0, 0.2], [1.0, 1.0], [0.2, 0.2]]
    assert disagreement_ratio(groups, {0.2: 5 / 8, 1.0: 3 / 8}) == pytest.approx(8 / 15)
    # three leaves, shares 1/6 and 5/6: expected 2 x (1 - 1/216 - 125/216) = 0.8333 < 1 observed
    assert disagreement_ratio([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], {1.0: 1 / 6, 0.0: 5 / 6}) == 1.0
    assert disagreement_ratio([[0.2], [1.0]], {0.2: 0.5, 1.0: 0.5}) == 1.0  # one leaf each


def test_branch_gains_are_zero_for_mixed_prompts_and_scaled_reward_rarity_otherwise():
    # q = 8/15 x (1 - share of the prompt's reward): 0.2 -> 8/15 x 3/8 = 0.2, 1.0 -> 8/15 x 5/8
    assert branch_gains(allocation_batch()) == pytest.approx({0: 0.2, 1: 0.0, 2: 1 / 3, 3: 0.2})


def test_adaptive_counts_follow_the_marginal_gains_and_keep_the_total():
    # n 2, floor 1: each of the 8 trees keeps 1; 8 pooled. Marginal gains q (1 - q)^k:
    #   prompts 0 and 3 (q 0.2): 0.2, 0.16, 0.128, 0.1024
    #   prompt 2 (q 1/3): 0.333333, 0.222222, 0.148148;  prompt 1 (mixed): 0
    # The 8 largest: 0.333, 0.222, 0.2 x2, 0.16 x2, 0.148, then one of the two 0.128 (the RNG):
    # prompt 2 gets 3, prompts 0 and 3 get 2 and 3, prompt 1 none; within a prompt the tree
    # with fewer goes first.
    for seed in range(4):
        counts, gains = adaptive_counts(allocation_batch(), 2, 1, random.Random(seed))
        assert counts[2:6] == [1, 1, 3, 2]
        assert sorted([counts[0] + counts[1], counts[6] + counts[7]]) == [4, 5]
        assert sum(counts) == 2 * 8
    assert gains[2] == pytest.approx(1 / 3)


def test_adaptive_counts_respect_the_floor_and_the_cap_of_twice_n():
    # only prompt 0 has leaves that agree; floor 0 pools all 8 expansions
    trees = allocation_batch()[:4]  # prompts 0 (0.2, 0.2) and 1 (1.0, 0.2)
    counts, _ = adaptive_counts(trees, n=2, floor=0, rng=random.Random(0))
    # prompt 0 takes up to 2n = 4 per tree, the mixed prompt the rest
    assert counts == [4, 4, 0, 0]
    counts, _ = adaptive_counts(trees, n=3, floor=2, rng=random.Random(0))
    assert counts == [4, 4, 2, 2] and min(counts) >= 2


@pytest.mark.parametrize("seed", range(10))
def test_adaptive_rounds_keep_the_step_total_and_label_every_pick(seed):
    rng = random.Random(seed)
    trees = [random_tree(rng, t, t // 2) for t in range(8)]
    for rule in ("uniform", "entropy", "uncertainty"):
        sel = Selection(rule, allocate="adaptive", allocate_floor=1)
        picks = TreePlanner(TreeShape(2, 3, 1), random.Random(seed), sel).next_round(trees)
        assert len(picks) == 3 * 8
        assert all(e.reason is not None and "; adaptive: " in e.reason for e in picks)
        per_tree = [sum(e.tree_index == i for e in picks) for i in range(8)]
        assert min(per_tree) >= 1 and max(per_tree) <= 6
        for e in picks:
            assert e.node_id in trees[e.tree_index].expandable()


def test_rules_without_entropies_say_what_is_missing():
    tree = entropy_tree()
    tree.nodes[1].entropy = None
    planner = TreePlanner(TreeShape(1, 2, 1), random.Random(0), Selection("entropy"))
    with pytest.raises(ValueError, match="node 1 has no entropy"):
        planner.next_round([tree])
    with pytest.raises(ValueError, match="unknown selection rule"):
        Selection("greedy")
