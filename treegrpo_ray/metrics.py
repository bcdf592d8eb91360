"""Metric helpers: timed stages and tree statistics, with namespaced keys (STYLE: names)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from treegrpo_ray.budget import Budget
from treegrpo_ray.tree import Tree


@contextmanager
def timed(metrics: dict[str, float], stage: str) -> Iterator[None]:
    """Add the wall time of the block to ``metrics['timing/<stage>']`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/{stage}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


def peak_rss_bytes() -> int:
    """The most resident memory this process has held since it started (Linux ``VmHWM``; the
    memory Ray's monitor and the kernel count), in bytes; 0 where the kernel does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


VALID_ROLES = ("search", "answer")  # the roles of an action with a well-formed tag pair


def format_valid_share(trees: list[Tree]) -> float:
    """Share of the trees' actions (their nodes) whose role is a valid one."""
    actions = [node for tree in trees for node in tree.nodes]
    return sum(node.role in VALID_ROLES for node in actions) / max(1, len(actions))


def tree_metrics(trees: list[Tree]) -> dict[str, float]:
    """``tree/...`` statistics over the leaves of a batch of trees, and ``rollout/entropy_mean``:
    the mean sampling entropy per action token (nats) the engine reported, where it did."""
    rewards_by_group: dict[int, list[float]] = defaultdict(list)
    depths = []
    for tree in trees:
        for leaf in tree.leaves():
            rewards_by_group[tree.group_id].append(leaf.reward)
            depths.append(leaf.depth + 1)
    rewards = [r for group in rewards_by_group.values() for r in group]
    varied = [len(set(group)) > 1 for group in rewards_by_group.values()]
    measured = [n for t in trees for n in t.nodes if n.entropy is not None and n.action_ids]
    tokens = sum(len(n.action_ids) for n in measured)
    entropy = (
        {"rollout/entropy_mean": sum(n.entropy_mass for n in measured) / tokens} if tokens else {}
    )
    return {
        "tree/reward_mean": statistics.fmean(rewards),
        "tree/leaves": float(len(rewards)),
        "tree/nodes": float(sum(len(t.nodes) for t in trees)),
        "tree/groups": float(len(rewards_by_group)),
        "tree/groups_with_variance": statistics.fmean(varied),
        "tree/turns_mean": statistics.fmean(depths),
        "tree/format_valid_actions": format_valid_share(trees),
        **entropy,
    }


def budget_metrics(budget: Budget, groups: int) -> dict[str, float]:
    """``budget/...`` totals and per-prompt averages of a batch."""
    out = {f"budget/{k}": float(v) for k, v in budget.to_dict().items()}
    out.update({f"budget/{k}_per_prompt": v / max(groups, 1) for k, v in budget.to_dict().items()})
    return out


def prefix_cache_metrics(budget: Budget) -> dict[str, float]:
    """``rollout/...`` prefix work of a batch: tokens computed, tokens served from the cache, and
    the token hit rate cached / (cached + computed) (vLLM's definition of prefix-cache hit rate)."""
    looked_up = budget.prefill_tokens + budget.cached_tokens
    return {
        "rollout/prefill_tokens": float(budget.prefill_tokens),
        "rollout/cached_tokens": float(budget.cached_tokens),
        "rollout/cache_hit_rate": budget.cached_tokens / looked_up if looked_up else 0.0,
    }
