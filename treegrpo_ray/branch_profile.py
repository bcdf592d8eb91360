"""Branch-value profile: where a task's outcomes are decided, and what that predicts for a tree.

For a prompt with success chance p, the chance q(s) of success from a node s (an agent step) has
mean p; the share of the outcome variance already decided at s is ``rho = Var q(s) / p(1 - p)``.
Two leaves that share the path up to s and continue independently differ with probability
``2 p(1 - p)(1 - rho)``, two independent chains with ``2 p(1 - p)``. (Rewards with more than two
levels, e.g. the format-aware EM's 0 / 0.1 / 0.2 / 0.8 / 1, read the same way with "differ" for
"disagree": it is what gives a group a nonzero advantage.) So, pooled over prompts and weighted by
p(1 - p),

    rho_t = 1 - D_t / D_0,

where D_t is the disagreement rate of leaf pairs whose paths share exactly t agent steps and D_0
that of pairs sharing none, matched prompt by prompt (the between/within estimator over sibling
pairs; its interval resamples prompts). A branch after step t saves the share d_t of a chain's
generated tokens that lies before it and keeps a share 1 - rho_t of a fresh chain's disagreement:
a tree pays at equal tokens where rho_t < d_t.

Predicted share of prompts whose leaves' rewards differ (the prompts with a nonzero group
advantage): across prompts each reward level's chance follows a Beta with the level's measured
share and one concentration for all levels (a Dirichlet), fitted to D_0; within a prompt, the M trees are independent and the ``1 + N`` leaves of a one-round tree are
exchangeable with correlation the mean of their pairs' rho (exact for three pass/fail leaves,
where only pairs matter); a branch starts at one of the original chain's T expandable positions uniformly
(the ``uniform`` planner), i.e. after t = 0 ... T - 1 shared steps. Chain GRPO is N = 0. Every
probability is a polynomial in a level's chance, so the average over prompts is exact from the
Beta's moments.

The input is a list of ``Tree`` (a run's saved trees or a rollout-only probe); groups are prompts.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from treegrpo_ray.errors import UserInputError
from treegrpo_ray.tree import Tree, common_prefix_length


@dataclass(frozen=True)
class Pair:
    """Two leaves of one prompt: the agent steps their paths share (0 for different trees or a
    branch from the prompt), the share of the later leaf's generated tokens in those steps, and
    whether their rewards differ."""

    shared_steps: int
    shared_token_share: float
    differ: bool


@dataclass(frozen=True)
class Chain:
    """An original chain (a tree's first leaf: an independent draw from the policy): its reward,
    and the generated tokens of each of its agent steps."""

    reward: float
    step_tokens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.step_tokens)

    def branch_tokens(self) -> float:
        """Expected generated tokens of a branch from a uniform expandable position of this chain
        (after 0 ... T - 1 shared steps), taken as the rest of the chain."""
        total = self.tokens
        return statistics.fmean(total - sum(self.step_tokens[:t]) for t in range(self.steps))

    @property
    def steps(self) -> int:
        return len(self.step_tokens)


@dataclass
class PromptLeaves:
    """What the profile reads of one prompt group: its leaves' rewards, its leaf pairs, its
    original chains."""

    rewards: list[float] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)
    chains: list[Chain] = field(default_factory=list)

    def disagreement(self, shared_steps: int) -> tuple[int, int]:
        """(pairs that differ, pairs) among those sharing ``shared_steps`` steps."""
        return self._counts.get(shared_steps, (0, 0))

    @functools.cached_property
    def _counts(self) -> dict[int, tuple[int, int]]:
        counts: dict[int, tuple[int, int]] = {}
        for pair in self.pairs:
            differ, total = counts.get(pair.shared_steps, (0, 0))
            counts[pair.shared_steps] = (differ + pair.differ, total + 1)
        return counts

    @property
    def success_rate(self) -> float:
        """The share of its leaves with a reward of at least 0.5 (a correct answer)."""
        return statistics.fmean(r >= 0.5 for r in self.rewards)

    @property
    def has_variance(self) -> bool:
        """Whether its leaves' rewards differ (its group advantage is nonzero)."""
        return len(set(map(_level, self.rewards))) > 1


def _level(reward: float) -> float:
    return round(reward, 6)  # rewards travel as float32


@dataclass(frozen=True)
class _LeafPath:
    """A leaf as the pairs read it: its tree, the node ids and generated tokens along its path,
    its reward level."""

    tree_id: int
    node_ids: list[int]
    tokens: list[int]
    level: float

    def pair(self, later: _LeafPath) -> Pair:
        """This leaf with a ``later`` one of the same prompt."""
        same_tree = self.tree_id == later.tree_id
        shared = common_prefix_length(self.node_ids, later.node_ids) if same_tree else 0
        share = sum(later.tokens[:shared]) / max(sum(later.tokens), 1)
        return Pair(shared, share, self.level != later.level)


def prompt_leaves(trees: Iterable[Tree], key: object = None) -> dict[object, PromptLeaves]:
    """Group the trees' leaves by prompt (``(key, group_id)``) into rewards, pairs and chains."""
    prompts: dict[object, PromptLeaves] = defaultdict(PromptLeaves)
    paths: dict[object, list[_LeafPath]] = defaultdict(list)
    for tree in trees:
        prompt = prompts[(key, tree.group_id)]
        for index, leaf in enumerate(tree.leaves()):
            ids = [n.node_id for n in tree.path(leaf.node_id)]
            tokens = [len(tree.node(i).action_ids) for i in ids]
            prompt.rewards.append(leaf.reward)
            paths[(key, tree.group_id)].append(
                _LeafPath(tree.tree_id, ids, tokens, _level(leaf.reward))
            )
            if index == 0:  # nodes are in creation order: the first leaf ends the seeding chain
                prompt.chains.append(Chain(leaf.reward, tuple(tokens)))
    for group, leaves in paths.items():
        prompts[group].pairs.extend(a.pair(b) for a, b in itertools.combinations(leaves, 2))
    return dict(prompts)


@dataclass(frozen=True)
class Depth:
    """The profile at one branch point: after ``shared_steps`` agent steps. ``rho`` (None where
    no prompt has both kinds of pair) with its 95% interval; ``token_share``: mean share of a
    leaf's generated tokens before the branch (d)."""

    shared_steps: int
    pairs: int
    disagreement: float
    rho: float | None
    rho_low: float | None
    rho_high: float | None
    token_share: float


def _rho(prompts: Sequence[PromptLeaves], shared_steps: int) -> float | None:
    """1 - D_t / D_0 with D_0 taken prompt by prompt, weighted by the prompt's t-pairs."""
    differ, expected = 0.0, 0.0
    for prompt in prompts:
        d0_differ, d0_pairs = prompt.disagreement(0)
        t_differ, t_pairs = prompt.disagreement(shared_steps)
        if d0_pairs and t_pairs:
            differ += t_differ
            expected += t_pairs * d0_differ / d0_pairs
    return None if expected == 0 else 1.0 - differ / expected


def depth_profile(
    prompts: Sequence[PromptLeaves], resamples: int = 1000, seed: int = 0
) -> list[Depth]:
    """rho_t, its 95% interval (prompts resampled with replacement) and d_t, for every t >= 1
    at which some pair branched; t = 0 (independent pairs) comes first with rho 0."""
    depths = sorted({p.shared_steps for prompt in prompts for p in prompt.pairs})
    rng = random.Random(seed)
    draws = [[rng.choice(prompts) for _ in prompts] for _ in range(resamples)]
    out = []
    for t in depths:
        at = [p for prompt in prompts for p in prompt.pairs if p.shared_steps == t]
        rho = 0.0 if t == 0 else _rho(prompts, t)
        boot = sorted(r for draw in draws if (r := _rho(draw, t)) is not None) if t else []
        low, high = rho, rho
        if boot:
            low, high = boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]
        out.append(
            Depth(
                shared_steps=t,
                pairs=len(at),
                disagreement=statistics.fmean(p.differ for p in at),
                rho=rho,
                rho_low=low,
                rho_high=high,
                token_share=statistics.fmean(p.shared_token_share for p in at),
            )
        )
    return out


@dataclass(frozen=True)
class PromptMix:
    """How rewards spread over prompts: ``levels`` maps each reward level to its share of all
    leaves; ``differ`` is D_0, the chance that two independent leaves of one prompt differ. With
    pass/fail rewards and success chance p: levels {1: E p, 0: 1 - E p}, differ 2 E[p(1 - p)]."""

    levels: dict[float, float]
    differ: float
    prompts: int

    @property
    def within(self) -> float:
        """The share of the reward-level variance found within prompts, D_0 / (1 - sum m^2):
        1 when every prompt has the same chances, 0 when each prompt always gets one level."""
        spread = 1.0 - sum(m * m for m in self.levels.values())
        return min(self.differ / spread, 1.0) if spread > 1e-12 else 1.0

    def moments(self, mean: float, degree: int) -> list[float]:
        """E[pi^j], j = 0 ... degree, of a level's chance pi across prompts: a Beta with mean
        ``mean`` and concentration c = within / (1 - within) (a point mass at ``mean`` when
        within is 1; masses at 0 and 1 when it is 0)."""
        if self.within >= 1.0 - 1e-12:
            return [mean**j for j in range(degree + 1)]
        if self.within <= 1e-12:
            return [1.0] + [mean] * degree
        c = self.within / (1.0 - self.within)
        out, value = [1.0], 1.0
        for j in range(degree):
            value *= (mean * c + j) / (c + j)
            out.append(value)
        return out


def prompt_mix(prompts: Sequence[PromptLeaves]) -> PromptMix:
    """``PromptMix`` over the prompts with at least one independent pair; raises UserInputError
    when none has one (a tree of M = 1 whose branches never start from the prompt)."""
    usable = [p for p in prompts if p.disagreement(0)[1]]
    if not usable:
        raise UserInputError(
            "no prompt has two independent leaves (different trees, or a branch from the "
            "prompt): profile trees with M >= 2 (e.g. a probe of shape 4x2x1)"
        )
    differ = statistics.fmean(d / n for d, n in (p.disagreement(0) for p in usable))
    rewards = [_level(r) for p in usable for r in p.rewards]
    levels = {level: rewards.count(level) / len(rewards) for level in sorted(set(rewards))}
    return PromptMix(levels, differ, len(usable))


Poly = list[float]  # coefficients of 1, p, p^2, ...


def _mul(a: Poly, b: Poly) -> Poly:
    out = [0.0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] += x * y
    return out


def _add(a: Poly, b: Poly, scale: float = 1.0) -> Poly:
    out = [0.0] * max(len(a), len(b))
    for i, x in enumerate(a):
        out[i] += x
    for i, y in enumerate(b):
        out[i] += scale * y
    return out


def _all_same(leaves: int, rho: float) -> Poly:
    """P(all of ``leaves`` exchangeable leaves get one level | its chance p) with pair
    correlation ``rho``: the beta-binomial prod_i (p(1 - rho) + i rho) / (1 + (i - 1) rho), i = 0 ... leaves - 1."""
    out: Poly = [0.0, 1.0]  # i = 0: p
    for i in range(1, leaves):
        scale = 1.0 / (1 + (i - 1) * rho)
        out = _mul(out, [i * rho * scale, (1 - rho) * scale])
    return out


@dataclass(frozen=True)
class Shape:
    """An arm's rollout shape: ``m`` trees per prompt, ``n`` branches per tree (one round)."""

    m: int
    n: int

    @classmethod
    def of_arm(cls, name: str) -> Shape:
        """``chain-G`` or ``tree-MxNx1``."""
        kind, _, spec = name.partition("-")
        if kind == "chain" and spec.isdigit():
            return cls(int(spec), 0)
        parts = spec.split("x")
        if kind == "tree" and len(parts) == 3 and all(x.isdigit() for x in parts):
            m, n, rounds = map(int, parts)
            if rounds == 1:
                return cls(m, n)
        raise UserInputError(f"cannot profile arm {name!r}: give chain-G or tree-MxNx1 (one round)")


def _rho_at(depths: Sequence[Depth]) -> dict[int, float]:
    """rho by shared steps, carried forward over depths without an estimate (rho_t can only
    grow with t: the outcome is a martingale)."""
    known = {d.shared_steps: d.rho for d in depths if d.rho is not None}
    top = max([*known, 0]) + 8
    out, last = {}, 0.0
    for t in range(top + 1):
        last = max(known.get(t, last), 0.0)
        out[t] = last
    return out


def _tree_all_same(shape: Shape, steps: int, rho: dict[int, float]) -> Poly:
    """P(all leaves of one tree get one level | its chance p), its branches drawn uniformly after 0 ... steps - 1
    shared steps of the original chain."""
    total: Poly = [0.0]
    draws = list(itertools.product(range(steps), repeat=shape.n))
    for draw in draws:
        pair_rhos = [rho.get(t, rho[max(rho)]) for t in draw]
        pair_rhos += [rho.get(min(a, b), 0.0) for a, b in itertools.combinations(draw, 2)]
        mean_rho = statistics.fmean(pair_rhos) if pair_rhos else 0.0
        total = _add(total, _all_same(1 + shape.n, mean_rho), 1 / len(draws))
    return total


@dataclass(frozen=True)
class Prediction:
    """An arm's predicted share of prompts with reward variance; its generated tokens per
    prompt in chains (one original chain = 1); the independent chains per prompt that would give
    the same share (``effective_chains``); and its share minus that of chains spending its tokens
    (``gap_at_equal_tokens``, 0 for a chain arm)."""

    arm: str
    share: float
    chains_of_tokens: float
    effective_chains: float
    gap_at_equal_tokens: float


@dataclass(frozen=True)
class Profile:
    """What the predictions read: the prompt mix, rho by branch point, the original chains."""

    mix: PromptMix
    depths: Sequence[Depth]
    chains: Sequence[Chain]

    def share(self, shape: Shape) -> float:
        """The share of prompts whose leaves' rewards differ for ``shape`` (module docstring),
        averaged over the original chains' lengths."""
        rho = _rho_at(self.depths)
        by_steps: dict[int, int] = defaultdict(int)
        for chain in self.chains:
            by_steps[chain.steps] += 1
        tree: Poly = [0.0]
        for steps, count in by_steps.items():
            tree = _add(tree, _tree_all_same(shape, steps, rho), count / len(self.chains))
        same: Poly = [1.0]  # P(every leaf of the prompt gets one given level | its chance pi)
        for _ in range(shape.m):
            same = _mul(same, tree)
        equal = 0.0
        for mean in self.mix.levels.values():
            moments = self.mix.moments(mean, len(same) - 1)
            equal += sum(c * m for c, m in zip(same, moments, strict=True))
        return 1.0 - equal

    def chains_share(self, chains: float) -> float:
        """The share of ``chains`` independent chains per prompt, linear between integers."""
        low = math.floor(chains)
        at_low = self.share(Shape(low, 0)) if low >= 1 else 0.0
        if chains == low:
            return at_low
        return at_low + (chains - low) * (self.share(Shape(low + 1, 0)) - at_low)

    def effective_chains(self, share: float, most: int = 64) -> float:
        """The chains per prompt whose share is ``share`` (``most`` when more are needed)."""
        below = 0.0
        for k in range(1, most + 1):
            at = self.share(Shape(k, 0))
            if at >= share:
                return k - 1 + (share - below) / (at - below) if at > below else float(k)
            below = at
        return float(most)

    def predict(self, arm: str) -> Prediction:
        shape = Shape.of_arm(arm)
        branch = statistics.fmean(c.branch_tokens() / max(c.tokens, 1) for c in self.chains)
        tokens = shape.m * (1 + shape.n * branch)
        share = self.share(shape)
        return Prediction(
            arm, share, tokens, self.effective_chains(share), share - self.chains_share(tokens)
        )
