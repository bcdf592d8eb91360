"""The rollout worker in-process with the tiny model and the multihop environment."""

from collections import Counter

import pytest
import torch

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.config import SamplingConfig, TreeConfig
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.tree import batch_info, trees_from_arrow


def _expand(cfg, policy, tree: TreeConfig, sampling=None, prompts=8, seed=3):
    worker = RolloutWorker(policy, cfg.task, tree, sampling or cfg.sampling, seed=0)
    samples = MultihopTask(cfg.task.multihop).train_samples()[:prompts]
    table = worker.expand(Lease(lease_id=0, groups=tuple(enumerate(samples)), seed=seed))
    return trees_from_arrow(table), batch_info(table)


def test_an_evaluation_of_a_version_the_worker_does_not_hold_is_refused(tiny_cfg, untrained_policy):
    """A worker whose load of the evaluated version failed (in a job: the weights' owner, the
    learner, had exited) refuses the shard instead of measuring the policy it holds."""
    worker = RolloutWorker(untrained_policy, tiny_cfg.task, tiny_cfg.tree, tiny_cfg.sampling)
    samples = MultihopTask(tiny_cfg.task.multihop).heldout_samples()[:2]
    assert len(worker.evaluate(samples, 0.0, seed=0, version=0)) == 2
    with pytest.raises(RuntimeError, match="holds version 0, its load of version 1 failed"):
        worker.evaluate(samples, 0.0, seed=0, version=1)


@pytest.mark.parametrize("m,n,l", [(2, 2, 1), (1, 3, 2), (3, 1, 1)])
def test_every_tree_ends_with_one_plus_l_times_n_leaves(tiny_cfg, untrained_policy, m, n, l):  # noqa: E741
    trees, _ = _expand(tiny_cfg, untrained_policy, TreeConfig(m=m, n=n, l=l))
    assert Counter(t.group_id for t in trees) == {g: m for g in range(8)}
    assert [len(t.leaves()) for t in trees] == [1 + l * n] * len(trees)
    for tree in trees:  # every leaf is the end of a branch: no node below a finished one
        parents = {node.parent_id for node in tree.nodes}
        assert not any(tree.node(p).finished for p in parents if p >= 0)


def test_n_zero_gives_independent_chains(tiny_cfg, untrained_policy):
    trees, _ = _expand(tiny_cfg, untrained_policy, TreeConfig(m=4, n=0, l=3))
    for tree in trees:
        children = Counter(node.parent_id for node in tree.nodes)
        assert max(children.values()) == 1
        assert len(tree.leaves()) == 1


@pytest.mark.slow  # needs actions that search and answer: the warm-started policy
def test_budget_counters_equal_what_was_produced(tiny_cfg, tiny_policy):
    trees, info = _expand(tiny_cfg, tiny_policy, TreeConfig(m=2, n=2, l=1))
    assert sorted(info.budgets) == sorted({t.group_id for t in trees})
    for group_id, budget in info.budgets.items():
        nodes = [n for t in trees if t.group_id == group_id for n in t.nodes]
        assert budget.generated_tokens == sum(len(n.action_ids) for n in nodes)
        assert budget.tool_calls == sum(n.tool_call for n in nodes)
        assert budget.leaves == sum(n.finished for n in nodes)
        assert budget.cached_tokens == sum(n.cached_tokens for n in nodes)  # no K-pruning here
        assert budget.prefill_tokens > 0
    assert sum(b.tool_calls for b in info.budgets.values()) > 0
    # a branch from an inner node is conditioned on a prefix the cache already holds
    assert sum(n.cached_tokens for t in trees for n in t.nodes) > 0


def test_over_long_actions_become_leaves_with_no_answer(tiny_cfg, untrained_policy):
    sampling = SamplingConfig(max_action_tokens=1)  # no action fits in one token
    trees, _ = _expand(tiny_cfg, untrained_policy, TreeConfig(m=1, n=2, l=1), sampling)
    leaves = [leaf for t in trees for leaf in t.leaves()]
    assert {leaf.finish_reason for leaf in leaves} == {"length"}
    assert {leaf.reward for leaf in leaves} == {0.0}
    assert all(len(leaf.action_ids) == 1 and leaf.obs_ids == [] for leaf in leaves)


def test_same_lease_seed_gives_the_same_trees(tiny_cfg, untrained_policy):
    first, _ = _expand(tiny_cfg, untrained_policy, TreeConfig(m=2, n=2, l=1), seed=11)
    again, _ = _expand(tiny_cfg, untrained_policy, TreeConfig(m=2, n=2, l=1), seed=11)
    other, _ = _expand(tiny_cfg, untrained_policy, TreeConfig(m=2, n=2, l=1), seed=12)

    def tokens(trees):
        return [n.action_ids for t in trees for n in t.nodes]

    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)


def test_an_evaluation_leaves_the_prefix_cache_empty(tiny_cfg, untrained_policy):
    """A prefix's KV computed in an evaluation's batches differs in float noise from a rollout's:
    none may stay behind for the next lease to draw on."""
    shape = TreeConfig(m=2, n=2, l=1)
    worker = RolloutWorker(untrained_policy, tiny_cfg.task, shape, tiny_cfg.sampling)
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()[:4]
    worker.expand(Lease(lease_id=0, groups=tuple(enumerate(samples)), seed=3))
    filled = worker.cache_stats()
    worker.evaluate(samples, temperature=0.0, seed=0, version=0)
    after = worker.cache_stats()
    assert filled.bytes > 0 and after.bytes == 0
    assert after.prefill_tokens > filled.prefill_tokens  # the counters stay


@pytest.mark.parametrize(
    "select,allocate", [("entropy", "fixed"), ("uncertainty", "adaptive"), ("uniform", "adaptive")]
)
def test_selection_rules_keep_the_step_total_and_label_their_branches(
    tiny_cfg, untrained_policy, select, allocate
):
    tree = TreeConfig(m=2, n=2, l=1, select=select, allocate=allocate)
    trees, info = _expand(tiny_cfg, untrained_policy, tree)
    leaves = [len(t.leaves()) for t in trees]
    assert sum(leaves) == 8 * 2 * 3  # M (1 + L N) per prompt, on average over the step
    if allocate == "fixed":
        assert leaves == [3] * 16
    for t in trees:
        assert all(n.entropy is not None and n.entropy >= 0 for n in t.nodes)
        # the first node of every branch a round started says why; the initial chain's does not
        labelled = [n for n in t.nodes if n.select_reason is not None]
        assert len(labelled) == len(t.leaves()) - 1
        assert all(n.select_reason.startswith(select) for n in labelled)
        assert all(n.select_score is not None for n in labelled)
    again, _ = _expand(tiny_cfg, untrained_policy, tree)
    assert [n.action_ids for t in again for n in t.nodes] == [
        n.action_ids for t in trees for n in t.nodes
    ]
    assert 0 <= info.planner_seconds <= info.rollout_seconds


class GenerateOnly:
    """Test adapter: the engine seen through ``generate`` alone, as the rollout worker sees vLLM
    (it then advances the branches in waves, ``WaveStepper``)."""

    def __init__(self, engine):
        self.engine = engine
        self.version = engine.version

    def generate(self, requests):
        return self.engine.generate(requests)

    def cache_stats(self):
        return self.engine.cache_stats()

    def forget_prefixes(self):
        self.engine.forget_prefixes()


def _leaf_paths(trees):
    """Per tree, its root-to-leaf action token paths with their rewards and log-probs, sorted:
    the tree up to the numbering of its nodes (which follows the order branches finish in)."""
    out = []
    for tree in trees:
        paths = []
        for leaf in tree.leaves():
            tokens, logprobs, node = [], [], leaf
            while True:
                tokens.append(tuple(node.action_ids))
                logprobs += node.action_logprobs
                if node.parent_id < 0:
                    break
                node = tree.node(node.parent_id)
            paths.append((tuple(reversed(tokens)), leaf.reward, logprobs))
        out.append((tree.tree_id, sorted(paths, key=lambda p: p[:2])))
    return out


def test_trees_do_not_depend_on_the_scheduling(tiny_cfg, untrained_policy):
    """Continuous batching (each branch's next turn submitted when its observation is back), one
    sequence at a time, a KV byte bound that holds about two rows, and lock-step waves give the same
    trees: every request has its own seed, derived from its branch's, and a row's tokens do not
    depend on its batch neighbours; the bounded engine never holds more KV than its bound."""
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()[:6]
    lease = Lease(lease_id=0, groups=tuple(enumerate(samples)), seed=7)
    shape = TreeConfig(m=2, n=2, l=1)
    kv_bound = 2**18  # about two rows' slots of the tiny policy (1 KiB a token): one took 147 KB
    results, peaks = {}, {}
    for name, bounds, waves in (
        ("continuous", {}, False),
        ("one", {"max_num_seqs": 1}, False),
        ("kv-bound", {"max_kv_bytes": kv_bound}, False),
        ("waves", {}, True),
    ):
        engine = tiny_cfg.engine.model_copy(update=bounds)
        worker = RolloutWorker(untrained_policy, tiny_cfg.task, shape, tiny_cfg.sampling, engine)
        if waves:
            worker.engine = GenerateOnly(worker.engine)
        results[name] = _leaf_paths(trees_from_arrow(worker.expand(lease)))
        peaks[name] = getattr(worker.engine, "peak_kv_bytes", 0)
    assert 0 < peaks["kv-bound"] <= kv_bound < peaks["continuous"]
    continuous = results["continuous"]
    assert sum(len(paths) for _, paths in continuous) == 6 * 2 * 3
    for name in ("one", "kv-bound", "waves"):
        other = results[name]
        assert [(t, [p[:2] for p in paths]) for t, paths in other] == [
            (t, [p[:2] for p in paths]) for t, paths in continuous
        ], name
        for (_, got), (_, want) in zip(other, continuous, strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(
                    torch.tensor(g[2]), torch.tensor(w[2]), atol=1e-5, rtol=0
                )
