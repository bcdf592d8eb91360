"""The branch-value profile: pairs and rho by hand, predictions by hand, and the estimator and
predictions against a simulated task whose rho is known."""

from __future__ import annotations

import math
import random

import pytest

from treegrpo_ray.branch_profile import (
    Chain,
    Depth,
    Pair,
    Profile,
    PromptLeaves,
    PromptMix,
    Shape,
    _all_same,
    depth_profile,
    prompt_leaves,
    prompt_mix,
)
from treegrpo_ray.tree import ROOT, Tree


def _step(tree: Tree, parent: int, tokens: int, reward: float | None = None) -> int:
    node = tree.add(
        parent,
        action_ids=[1] * tokens,
        action_logprobs=[0.0] * tokens,
        obs_ids=[2, 2],
        finished=reward is not None,
        finish_reason="stop",
        policy_version=0,
        role="answer" if reward is not None else "search",
        tool_call=reward is None,
        reward=math.nan if reward is None else reward,
    )
    return node.node_id


def _tree(tree_id: int, group: int, chain: list[int], reward: float) -> Tree:
    """One tree seeded by a chain with ``chain`` tokens per step (the last step ends it)."""
    tree = Tree(tree_id, group, [5, 6])
    parent = ROOT
    for i, tokens in enumerate(chain):
        last = i == len(chain) - 1
        parent = _step(tree, parent, tokens, reward if last else None)
    return tree


def test_pairs_count_shared_steps_and_tokens():
    tree = _tree(0, 7, [10, 20, 30], 1.0)  # nodes 0, 1, 2 (leaf)
    _step(tree, _step(tree, 0, 4), 6, 0.0)  # branch after step 1: nodes 3, 4 (leaf)
    _step(tree, ROOT, 8, 1.0)  # branch from the prompt: node 5 (leaf)
    other = _tree(1, 7, [9], 0.0)  # a second tree of the same prompt
    prompts = prompt_leaves([tree, other], key="u1")
    prompt = prompts[("u1", 7)]
    assert prompt.rewards == [1.0, 0.0, 1.0, 0.0]
    assert prompt.chains == [Chain(1.0, (10, 20, 30)), Chain(0.0, (9,))]
    assert prompt.pairs == [
        Pair(1, 10 / 20, True),  # original and the node-0 branch share step 0 (10 of 10 + 4 + 6)
        Pair(0, 0.0, False),  # original and the prompt branch
        Pair(0, 0.0, True),  # original and the other tree
        Pair(0, 0.0, True),  # node-0 branch and prompt branch
        Pair(0, 0.0, False),  # node-0 branch and the other tree
        Pair(0, 0.0, True),  # prompt branch and the other tree
    ]
    assert prompt.disagreement(0) == (3, 5)
    assert prompt.has_variance and prompt.success_rate == 0.5


def _prompt(independent: tuple[int, int], at_one: tuple[int, int]) -> PromptLeaves:
    """(differ, pairs) of independent pairs and of pairs sharing one step."""
    pairs = [Pair(0, 0.0, i < independent[0]) for i in range(independent[1])]
    pairs += [Pair(1, 0.25, i < at_one[0]) for i in range(at_one[1])]
    return PromptLeaves(rewards=[1.0, 0.0], pairs=pairs)


def test_rho_matches_disagreements_prompt_by_prompt():
    # prompt a: D_0 = 2/4, 4 one-step pairs of which 1 differs; prompt b: D_0 = 1/2, 2 of 2 differ;
    # prompt c has no independent pair and is left out.
    prompts = [_prompt((2, 4), (1, 4)), _prompt((1, 2), (2, 2)), _prompt((0, 0), (1, 1))]
    depths = depth_profile(prompts, resamples=50)
    assert [d.shared_steps for d in depths] == [0, 1]
    # expected differ at t = 1: 4 * 0.5 + 2 * 0.5 = 3; seen: 1 + 2 = 3 -> rho = 0
    assert depths[1].rho == pytest.approx(0.0)
    assert depths[1].pairs == 7 and depths[1].token_share == pytest.approx(0.25)
    assert depths[1].disagreement == pytest.approx(4 / 7)
    assert depths[1].rho_low <= 0.0 <= depths[1].rho_high
    prompts[1] = _prompt((1, 2), (0, 2))  # seen 1 of 3 expected: rho = 2/3
    assert depth_profile(prompts, resamples=50)[1].rho == pytest.approx(2 / 3)


def test_all_same_is_the_beta_binomial():
    # three leaves, pair correlation 0.5, p = 0.4: p (p/2 + 1/2)(p/2 + 1) / 1.5
    p, poly = 0.4, _all_same(3, 0.5)
    assert sum(c * p**i for i, c in enumerate(poly)) == pytest.approx(0.4 * 0.7 * 1.2 / 1.5)
    assert _all_same(3, 0.0) == pytest.approx([0, 0, 0, 1])  # p^3
    assert sum(_all_same(4, 1.0)[1:]) == pytest.approx(1.0)  # one coin: P = p


def _binary(mean: float, within: float) -> PromptMix:
    """Pass/fail rewards with success chance of mean ``mean`` and E[p(1 - p)] = ``within``."""
    return PromptMix({0.0: 1 - mean, 1.0: mean}, differ=2 * within, prompts=10)


def test_beta_moments():
    # mean 1/2, E[p(1-p)] = 1/4 - 1/12: Beta(1, 1), E p^2 = 1/3, E p^3 = 1/4
    mix = _binary(0.5, 0.25 - 1 / 12)
    assert mix.within == pytest.approx(2 / 3)  # c = 2
    assert mix.moments(0.5, 3) == pytest.approx([1, 0.5, 1 / 3, 1 / 4])
    assert _binary(0.3, 0.21).moments(0.3, 2) == pytest.approx([1, 0.3, 0.09])  # point mass
    assert _binary(0.3, 0.0).moments(0.3, 2) == pytest.approx([1, 0.3, 0.3])  # p is 0 or 1


def test_reward_levels_beyond_pass_fail():
    # every prompt with chances 0.5 / 0.25 / 0.25 of rewards 0.1 / 0.2 / 1 (a point mass):
    # two chains differ with 1 - (0.25 + 2 * 0.0625) = 0.625, three with 1 - (0.125 + 2 / 64)
    mix = PromptMix({0.1: 0.5, 0.2: 0.25, 1.0: 0.25}, differ=0.625, prompts=10)
    profile = Profile(mix, [Depth(0, 10, 0.625, 0.0, 0.0, 0.0, 0.0)], [Chain(1.0, (10,))])
    assert profile.predict("chain-2").share == pytest.approx(0.625)
    assert profile.predict("chain-3").share == pytest.approx(0.84375)
    prompt = PromptLeaves(rewards=[0.2, 0.2000000029802322])  # 0.2 as float32 and float64
    assert not prompt.has_variance


def test_predictions_by_hand():
    depths = [Depth(0, 10, 0.4, 0.0, 0.0, 0.0, 0.0), Depth(1, 10, 0.24, 0.4, 0.3, 0.5, 0.5)]
    chains = [Chain(1.0, (10, 30))]  # two steps: a branch after 0 or 1 step, tokens 40 or 30
    profile = Profile(_binary(0.5, 0.2), depths, chains)
    # chains: 2 E[p(1 - p)] and 3 E[p(1 - p)], whatever the Beta
    assert profile.predict("chain-2").share == pytest.approx(0.4)
    assert profile.predict("chain-3").share == pytest.approx(0.6)
    # tree (1,2,1): E[p(1-p)] (3 - E sum of pair rhos); draws (0,0) (0,1) (1,0) (1,1) give
    # 0, rho1, rho1, 3 rho1 -> mean 1.25 * 0.4 = 0.5 -> 0.2 * 2.5 = 0.5
    tree = profile.predict("tree-1x2x1")
    assert tree.share == pytest.approx(0.5)
    # tokens: 1 + 2 * mean(40/40, 30/40) = 2.75 chains
    assert tree.chains_of_tokens == pytest.approx(2.75)
    # chains at 2.75 per prompt: 0.4 + 0.75 * (0.6 - 0.4) = 0.55; the tree: 0.5 - 0.55
    assert tree.gap_at_equal_tokens == pytest.approx(-0.05)
    # chain-1 shares nothing: the tree's 0.5 lies 0.1 / 0.2 of the way from chain-2 to chain-3
    assert tree.effective_chains == pytest.approx(2.5)
    assert profile.predict("chain-3").effective_chains == pytest.approx(3)


def test_unprofilable_input_is_explained():
    with pytest.raises(ValueError, match="tree-MxNx1"):
        Shape.of_arm("tree-1x2x2")
    with pytest.raises(ValueError, match="M >= 2"):
        prompt_mix([_prompt((0, 0), (1, 2))])


def _grow(tree: Tree, parent: int, p: float, decided: tuple[float, float], rng: random.Random):
    """Complete a 3-step chain from ``parent``: before step t (t = 0, 1) the outcome, if still
    open, is decided with probability decided[t]; it is drawn at the end otherwise. A node's
    ``obs_ids`` carry its decided outcome (2: open) so that branches from it inherit it."""
    depth = 0 if parent == ROOT else tree.node(parent).depth + 1
    outcome = (
        None if parent == ROOT or tree.node(parent).obs_ids == [2] else tree.node(parent).obs_ids[0]
    )
    while depth < 2:
        if outcome is None and rng.random() < decided[depth]:
            outcome = int(rng.random() < p)
        parent = _step(tree, parent, 10)
        tree.node(parent).obs_ids = [2] if outcome is None else [outcome]
        depth += 1
    final = outcome if outcome is not None else int(rng.random() < p)
    _step(tree, parent, 10, float(final))


def _simulated_prompts(prompts: int, decided: tuple[float, float], seed: int) -> list[Tree]:
    """Trees of shape 4x2x1 (``_grow``'s task): rho_1 = h1, rho_2 = h1 + (1 - h1) h2 for
    decided = (h1, h2). Prompt success chances are Beta(1, 2)."""
    rng = random.Random(seed)
    trees: list[Tree] = []
    for group in range(prompts):
        p = rng.betavariate(1, 2)
        for j in range(4):
            tree = Tree(group * 4 + j, group, [5])
            _grow(tree, ROOT, p, decided, rng)
            for _ in range(2):  # uniform over the original's expandable positions
                _grow(tree, rng.choice([ROOT, 0, 1]), p, decided, rng)
            trees.append(tree)
    return trees


def test_profile_recovers_a_known_task():
    trees = _simulated_prompts(1500, (0.3, 0.5), seed=3)
    prompts = list(prompt_leaves(trees).values())
    depths = depth_profile(prompts, resamples=200)
    rho = {d.shared_steps: d for d in depths}
    assert rho[1].rho_low <= 0.3 <= rho[1].rho_high  # h1
    assert rho[2].rho_low <= 0.65 <= rho[2].rho_high  # h1 + (1 - h1) h2
    mix = prompt_mix(prompts)
    chains = [c for p in prompts for c in p.chains]
    profile = Profile(mix, depths, chains)
    # the probe's own shape, four 3-leaf trees per prompt, measured directly
    seen = sum(p.has_variance for p in prompts) / len(prompts)
    assert profile.predict("tree-4x2x1").share == pytest.approx(seen, abs=0.03)
    # one tree per prompt: the first tree of each prompt
    first = list(prompt_leaves(trees[::4]).values())
    seen_one = sum(p.has_variance for p in first) / len(first)
    assert profile.predict("tree-1x2x1").share == pytest.approx(seen_one, abs=0.03)
