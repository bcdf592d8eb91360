"""Tree-search planner: which prefixes to expand next (paper §3.1, DESIGN §1 and §9).

For each prompt: M trees, each seeded by one full chain from the root; then L rounds in each of which
N nodes per tree are chosen from the root and the non-leaf nodes, and each choice is completed into a
new branch. Every branch ends in exactly one new leaf, so a tree ends with ``1 + L * N`` leaves and a
prompt with ``M * (1 + L * N)``. Chain GRPO is N = 0 (or L = 0).

Which N nodes (``Selection.rule``):

- ``uniform`` (the paper's, default): N draws uniformly *with replacement*;
- ``entropy`` (after AT²PO): the N distinct nodes whose next action the policy was least sure of,
  minus a penalty per branch a node already has (nodes repeat only when fewer than N);
- ``uncertainty`` (after InfoTree's UUCB): N greedy picks, each the node with the largest sum of
  the uncertainty of its subtree's mean reward, a count-based exploration bonus (which falls as
  the node is picked) and the entropy of the actions below it.

How many per tree (``Selection.allocate``): ``fixed`` gives every tree N per round; ``adaptive``
keeps the round's total but moves expansions from prompts whose leaves already disagree to those
whose leaves share one reward, most to those whose reward is rarest in the batch. Scores and
their reasoning: docs/algorithm.md.

The planner is engine- and environment-agnostic and pure: it reads only the trees (rewards,
entropies, counts) and its RNG, and names (tree, node) pairs; the rollout worker completes the
branches in batched waves.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from treegrpo_ray.tree import ROOT, Tree

SelectRule = Literal["uniform", "entropy", "uncertainty"]
SELECT_RULES: tuple[str, ...] = get_args(SelectRule)
# A rule's score of one node: (its stats, times this round picked it, picks in its tree this round)
# -> (score, reason).
Scorer = Callable[["NodeStats", int, int], tuple[float, str]]
AllocateRule = Literal["fixed", "adaptive"]
ALLOCATE_RULES: tuple[str, ...] = get_args(AllocateRule)


@dataclass(frozen=True)
class TreeShape:
    """m: trees per prompt; n: nodes expanded per tree per round; l: rounds; k: leaves kept per tree
    (None keeps all)."""

    m: int
    n: int
    l: int  # noqa: E741 - the paper's name
    k: int | None = None

    @property
    def leaves_per_tree(self) -> int:
        return 1 + self.l * self.n

    @property
    def leaves_per_prompt(self) -> int:
        return self.m * self.leaves_per_tree


@dataclass(frozen=True)
class Selection:
    """How a round's expansions are chosen (the ``tree.*`` config documents each field)."""

    rule: SelectRule = "uniform"
    sibling_penalty: float = 0.05  # entropy: subtracted per branch a node already has beyond one
    exploration: float = 0.25  # uncertainty: c of the count bonus
    entropy_weight: float = 0.5  # uncertainty: weight of the subtree's token entropy
    prior_strength: float = 1.0  # uncertainty: pseudo-leaves of the prompt's mean reward
    allocate: AllocateRule = "fixed"
    allocate_floor: int = 1  # adaptive: expansions every tree keeps per round

    def __post_init__(self) -> None:
        if self.rule not in SELECT_RULES:
            raise ValueError(f"unknown selection rule {self.rule!r}; choose from {SELECT_RULES}")
        if self.allocate not in ALLOCATE_RULES:
            raise ValueError(f"unknown allocation {self.allocate!r}; choose from {ALLOCATE_RULES}")


@dataclass(frozen=True)
class Expansion:
    """Start a new branch in ``trees[tree_index]`` as a child of ``node_id`` (``ROOT`` = prompt).

    score / reason: why the planner chose this node (None for the initial chains and for the
    continuations of a branch)."""

    tree_index: int
    node_id: int
    score: float | None = None
    reason: str | None = None


@dataclass
class NodeStats:
    """What the selection rules read about one candidate node p of a tree.

    branches: actions sampled from p so far (its children); next_entropy: their mean token entropy;
    leaves / reward_sum: the leaves below p and their rewards' sum; subtree_entropy: the mean token
    entropy of every action below p, weighted by tokens (0 when they have none)."""

    branches: int
    next_entropy: float
    leaves: int
    reward_sum: float
    subtree_entropy: float


def node_stats(tree: Tree) -> dict[int, NodeStats]:
    """``NodeStats`` of every node a branch may start from (``tree.expandable()``), in one pass
    from the newest node up (a node is created after its parent, so its subtree is complete when
    it is reached)."""
    branches: dict[int, int] = defaultdict(int)
    next_mass: dict[int, float] = defaultdict(float)
    leaves: dict[int, int] = defaultdict(int)
    rewards: dict[int, float] = defaultdict(float)
    mass: dict[int, float] = defaultdict(float)
    tokens: dict[int, int] = defaultdict(int)
    for node in reversed(tree.nodes):
        v, p, length = node.node_id, node.parent_id, len(node.action_ids)
        if node.finished:
            leaves[v], rewards[v] = 1, node.reward
        branches[p] += 1
        next_mass[p] += node.entropy_mass / length if length else 0.0
        leaves[p] += leaves[v]
        rewards[p] += rewards[v]
        mass[p] += mass[v] + node.entropy_mass
        tokens[p] += tokens[v] + length
    return {
        p: NodeStats(
            branches=branches[p],
            next_entropy=next_mass[p] / branches[p],
            leaves=leaves[p],
            reward_sum=rewards[p],
            subtree_entropy=mass[p] / tokens[p] if tokens[p] else 0.0,
        )
        for p in tree.expandable()
    }


def entropy_score(s: NodeStats, penalty: float) -> tuple[float, str]:
    """AT²PO-style: ``H_next - penalty * (branches - 1)``: the next action's mean token entropy
    minus a penalty per branch the node already has beyond its first."""
    siblings = s.branches - 1
    score = s.next_entropy - penalty * siblings
    return score, f"entropy: next-action H {s.next_entropy:.3f} - {penalty} x {siblings} siblings"


def uncertainty_score(
    s: NodeStats, picked: int, tree_branches: int, prompt_mean: float, sel: Selection
) -> tuple[float, str]:
    """UUCB-style sum of three terms for a node p with ``picked`` choices this round so far:

    - outcome: posterior sd of p's mean reward, ``sqrt(mu (1 - mu) / (n + kappa + 1))`` with
      ``mu = (sum R + kappa * prompt_mean) / (n + kappa)`` over the n leaves below p;
    - exploration: ``c * sqrt(ln(1 + B) / b)``, b = actions sampled from p (children + picked),
      B = branches of the whole tree (its leaves + this round's choices so far);
    - entropy: ``beta * H_sub``, the token-weighted mean entropy of the actions below p.
    """
    kappa = sel.prior_strength
    mu = (s.reward_sum + kappa * prompt_mean) / (s.leaves + kappa)
    outcome = math.sqrt(max(mu * (1 - mu), 0.0) / (s.leaves + kappa + 1))
    explore = sel.exploration * math.sqrt(math.log(1 + tree_branches) / (s.branches + picked))
    entropy = sel.entropy_weight * s.subtree_entropy
    reason = (
        f"uncertainty: outcome sd {outcome:.3f} + explore {explore:.3f} + entropy "
        f"{sel.entropy_weight} x {s.subtree_entropy:.3f}"
    )
    return outcome + explore + entropy, reason


def prompt_mean_rewards(trees: list[Tree]) -> dict[int, float]:
    """Mean leaf reward per prompt group over all its trees."""
    rewards: dict[int, list[float]] = defaultdict(list)
    for tree in trees:
        rewards[tree.group_id] += [leaf.reward for leaf in tree.leaves()]
    return {group: sum(r) / len(r) for group, r in rewards.items()}


def branch_gains(trees: list[Tree]) -> dict[int, float]:
    """Per prompt group, q: the estimated probability that one more branch ends with a reward its
    leaves do not have yet. 0 for a prompt whose leaves already disagree (it has a gradient);
    otherwise ``s (1 - f(r))``: r = the reward all its leaves share, f(r) = the share of all leaves
    of ``trees`` with reward r (the chance of another reward if the prompt behaved like the whole
    batch), and s = ``disagreement_ratio`` (how much less often a prompt's own leaves disagree than
    leaves drawn from the batch would; 1 when no prompt has two leaves yet)."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for tree in trees:
        by_group[tree.group_id] += [leaf.reward for leaf in tree.leaves()]
    rewards = [r for group in by_group.values() for r in group]
    share = {r: rewards.count(r) / len(rewards) for r in set(rewards)}
    ratio = disagreement_ratio(list(by_group.values()), share)
    return {
        group: 0.0 if len(set(seen)) > 1 else ratio * (1 - share[seen[0]])
        for group, seen in by_group.items()
    }


def disagreement_ratio(groups: list[list[float]], share: dict[float, float]) -> float:
    """Prompts whose leaves disagree over the number expected if each leaf were an independent
    draw from the batch (``share``: reward -> its share of the leaves), over the prompts with two
    leaves or more, at most 1; 1 without such prompts. For 0/1 rewards this is
    ``1 - Var(p) / (mu (1 - mu))`` over the prompts' success rates p: prompts differ in
    difficulty, so a prompt's next leaf repeats its reward more often than the batch's mix says."""
    several = [g for g in groups if len(g) > 1]
    expected = sum(1 - sum(share[r] ** len(g) for r in set(share)) for g in several)
    if not several or expected == 0:
        return 1.0
    return min(1.0, sum(len(set(g)) > 1 for g in several) / expected)


def adaptive_counts(
    trees: list[Tree], n: int, floor: int, rng: random.Random
) -> tuple[list[int], dict[int, float]]:
    """Expansions per tree for one round: every tree keeps ``floor`` and gets at most ``2 n``; the
    other ``(n - floor)`` per tree go one at a time to the prompt with the largest marginal gain
    ``q (1 - q)^k`` (q from ``branch_gains``, k = expansions it got from the pool so far; ties:
    the fewest k, then the RNG), and within a prompt to its tree with the fewest. The total stays
    ``n * len(trees)``. Returns the counts (in tree order) and the q per prompt group."""
    gains = branch_gains(trees)
    trees_of: dict[int, list[int]] = defaultdict(list)
    for i, tree in enumerate(trees):
        trees_of[tree.group_id].append(i)
    counts = [floor] * len(trees)
    taken = dict.fromkeys(trees_of, 0)
    for _ in range((n - floor) * len(trees)):
        value = {
            g: (gains[g] * (1 - gains[g]) ** taken[g], -taken[g])
            for g, members in trees_of.items()
            if min(counts[i] for i in members) < 2 * n
        }
        best = max(value.values())
        tied = [g for g in value if value[g] == best]
        group = tied[0] if len(tied) == 1 else rng.choice(tied)
        taken[group] += 1
        counts[min(trees_of[group], key=lambda i: counts[i])] += 1
    return counts, gains


class TreePlanner:
    """Plans the expansion waves of one batch of trees."""

    def __init__(self, shape: TreeShape, rng: random.Random, selection: Selection | None = None):
        self.shape = shape
        self.rng = rng
        self.selection = selection or Selection()

    def initial(self, trees: list[Tree]) -> list[Expansion]:
        """One chain from the root of every tree."""
        return [Expansion(i, ROOT) for i in range(len(trees))]

    def rounds(self) -> int:
        return self.shape.l if self.shape.n > 0 else 0

    def next_round(self, trees: list[Tree]) -> list[Expansion]:
        """The round's expansions: per tree, its allocated count of nodes chosen by the rule."""
        n, sel = self.shape.n, self.selection
        counts, notes = [n] * len(trees), [""] * len(trees)
        if sel.allocate == "adaptive":
            counts, gains = adaptive_counts(trees, n, sel.allocate_floor, self.rng)
            notes = [
                f"; adaptive: {c} of nominal {n}, q {gains[t.group_id]:.3f}"
                for c, t in zip(counts, trees, strict=True)
            ]
        means = prompt_mean_rewards(trees) if sel.rule == "uncertainty" else {}
        expansions = []
        for i, (tree, count) in enumerate(zip(trees, counts, strict=True)):
            if sel.rule == "uniform":
                candidates = tree.expandable()
                share = 1 / len(candidates)
                reason = f"uniform: 1 of {len(candidates)} candidates{notes[i]}"
                expansions += [
                    Expansion(i, self.rng.choice(candidates), share, reason) for _ in range(count)
                ]
                continue
            score = self._scorer(tree, means.get(tree.group_id, 0.0))
            expansions += [
                Expansion(i, node, value, reason + notes[i])
                for node, value, reason in self.greedy(node_stats(tree), count, score)
            ]
        return expansions

    def _scorer(self, tree: Tree, prompt_mean: float) -> Scorer:
        """The rule's score of a node given (its stats, times this round picked it, picks in the
        tree this round)."""
        sel = self.selection
        if sel.rule == "entropy":
            return lambda s, _, __: entropy_score(s, sel.sibling_penalty)
        leaves = len(tree.leaves())
        return lambda s, picked, round_picks: uncertainty_score(
            s, picked, leaves + round_picks, prompt_mean, sel
        )

    def greedy(
        self, stats: dict[int, NodeStats], count: int, score: Scorer
    ) -> list[tuple[int, float, str]]:
        """``count`` picks, each the node with the highest score given the picks before it (ties
        drawn by the RNG); under the entropy rule a node is picked again only once every node has
        been picked as often (AT²PO's distinct top N). Returns (node id, score, reason) per
        pick."""
        distinct = self.selection.rule == "entropy"
        picked = dict.fromkeys(stats, 0)
        out = []
        for k in range(count):
            scored = {p: score(s, picked[p], k) for p, s in stats.items()}
            rank = {p: (-picked[p] if distinct else 0, value) for p, (value, _) in scored.items()}
            best = max(rank.values())
            tied = [p for p in stats if rank[p] == best]
            node = tied[0] if len(tied) == 1 else self.rng.choice(tied)
            picked[node] += 1
            out.append((node, *scored[node]))
        return out

    def prune(self, trees: list[Tree]) -> None:
        """Keep K leaves per tree (drawn uniformly without replacement) when K is set."""
        if self.shape.k is None:
            return
        for tree in trees:
            leaves = [n.node_id for n in tree.leaves()]
            if len(leaves) > self.shape.k:
                tree.keep_leaves(set(self.rng.sample(leaves, self.shape.k)))
