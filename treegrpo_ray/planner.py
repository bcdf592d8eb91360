"""Tree-search planner: which prefixes to expand next (paper §3.1, DESIGN §1).

For each prompt: M trees, each seeded by one full chain from the root; then L rounds in each of which
N nodes per tree are drawn uniformly *with replacement* from the root and the non-leaf nodes, and each
draw is completed into a new branch. Every branch ends in exactly one new leaf, so a tree ends with
``1 + L * N`` leaves and a prompt with ``M * (1 + L * N)``. Chain GRPO is N = 0 (or L = 0).

The planner is engine- and environment-agnostic: it only names (tree, node) pairs; the rollout worker
completes the branches in batched waves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from treegrpo_ray.tree import ROOT, Tree


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
class Expansion:
    """Start a new branch in ``trees[tree_index]`` as a child of ``node_id`` (``ROOT`` = prompt)."""

    tree_index: int
    node_id: int


class TreePlanner:
    """Plans the expansion waves of one batch of trees."""

    def __init__(self, shape: TreeShape, rng: random.Random):
        self.shape = shape
        self.rng = rng

    def initial(self, trees: list[Tree]) -> list[Expansion]:
        """One chain from the root of every tree."""
        return [Expansion(i, ROOT) for i in range(len(trees))]

    def rounds(self) -> int:
        return self.shape.l if self.shape.n > 0 else 0

    def next_round(self, trees: list[Tree]) -> list[Expansion]:
        """N draws per tree, uniform with replacement over the root and the non-leaf nodes."""
        expansions = []
        for i, tree in enumerate(trees):
            candidates = tree.expandable()
            expansions += [Expansion(i, self.rng.choice(candidates)) for _ in range(self.shape.n)]
        return expansions

    def prune(self, trees: list[Tree]) -> None:
        """Keep K leaves per tree (drawn uniformly without replacement) when K is set."""
        if self.shape.k is None:
            return
        for tree in trees:
            leaves = [n.node_id for n in tree.leaves()]
            if len(leaves) > self.shape.k:
                tree.keep_leaves(set(self.rng.sample(leaves, self.shape.k)))
