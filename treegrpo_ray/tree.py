"""Agent-step trees and their Arrow form (DESIGN §3).

A node is one complete agent step: the policy's action tokens followed by the environment's
observation tokens. The root is the prompt and is not a node; its children have ``parent_id == -1``.
Token ids are the truth; text is only for display.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from treegrpo_ray.budget import Budget

ROOT = -1

NODE_SCHEMA = pa.schema(
    [
        ("tree_id", pa.int64()),
        ("group_id", pa.int64()),
        ("node_id", pa.int32()),
        ("parent_id", pa.int32()),
        ("depth", pa.int32()),
        ("action_ids", pa.list_(pa.int32())),
        ("action_logprobs", pa.list_(pa.float32())),
        ("obs_ids", pa.list_(pa.int32())),
        ("finished", pa.bool_()),
        ("finish_reason", pa.string()),
        ("reward", pa.float32()),
        ("policy_version", pa.int32()),
        ("role", pa.string()),
        ("tool_call", pa.bool_()),
        # Prefix tokens of this node's generation that the engine served from its KV cache.
        ("cached_tokens", pa.int32()),
        # Optional (null where unknown, DESIGN §9): the action's mean token entropy under the
        # sampling distribution, and why the planner started this branch here (on the first node
        # of each branch: its parent's selection score and a readable reason).
        ("entropy", pa.float32()),
        ("select_score", pa.float32()),
        ("select_reason", pa.string()),
        # The prompt's token ids, stored once per tree: on its first row, null on the others.
        ("prompt_ids", pa.list_(pa.int32())),
    ]
)
TREE_COLUMNS = ("tree_id", "group_id", "prompt_ids")  # the tree's, repeated on its rows
NODE_COLUMNS = tuple(name for name in NODE_SCHEMA.names if name not in TREE_COLUMNS)  # AgentStep's


@dataclass(frozen=True)
class BatchInfo:
    """What travels with one tree batch (the Arrow schema's metadata): the lease it answers, the
    policy version that generated it, the measured cost per prompt group, the rollout's wall time
    and the part of it the planner spent choosing expansions (selection and allocation)."""

    lease_id: int
    policy_version: int
    budgets: dict[int, Budget]
    rollout_seconds: float
    planner_seconds: float = 0.0

    def to_json(self) -> str:
        budgets = {str(group): budget.to_dict() for group, budget in self.budgets.items()}
        return json.dumps({**vars(self), "budgets": budgets})

    @classmethod
    def from_json(cls, text: str) -> BatchInfo:
        data = json.loads(text)
        budgets = {int(group): Budget(**counts) for group, counts in data.pop("budgets").items()}
        return cls(budgets=budgets, **data)


@dataclass
class AgentStep:
    """One node: an action (generated tokens) and the observation the environment returned.

    ``reward`` is NaN except on leaves (``finished``). ``cached_tokens``: how many tokens of the
    prefix this action was generated from (prompt + path above it) the engine served from its KV
    cache rather than computed. ``entropy``: mean entropy (nats) of the distributions the action's
    tokens were sampled from (None: unknown, or no tokens). ``select_score`` / ``select_reason``:
    on the first node of a branch, the score with which the planner chose to branch from this
    node's parent and why (None elsewhere). ``env_state`` is the environment state after this
    step; it lets the tree branch from here and never leaves the rollout worker.
    """

    node_id: int
    parent_id: int
    depth: int
    action_ids: list[int]
    action_logprobs: list[float]
    obs_ids: list[int]
    finished: bool
    finish_reason: str
    policy_version: int
    role: str
    tool_call: bool
    reward: float = math.nan
    cached_tokens: int = 0
    entropy: float | None = None
    select_score: float | None = None
    select_reason: str | None = None
    env_state: Any = field(default=None, repr=False, compare=False)

    @property
    def token_count(self) -> int:
        return len(self.action_ids) + len(self.obs_ids)

    @property
    def entropy_mass(self) -> float:
        """Summed token entropy of the action (nats): ``entropy * len(action_ids)``, 0 for an
        empty action; an estimate of the entropy of the whole action given its prefix (chain
        rule)."""
        if not self.action_ids:
            return 0.0
        if self.entropy is None:
            raise ValueError(
                f"node {self.node_id} has no entropy, which the selection / allocation rule "
                "reads: use an engine that reports entropies (engine.vllm.entropy_topk > 0)"
            )
        return self.entropy * len(self.action_ids)


@dataclass
class Tree:
    """One search tree of a prompt group: the prompt and its agent-step nodes.

    Nodes are stored in creation order, so a parent always precedes its children.
    """

    tree_id: int
    group_id: int
    prompt_ids: list[int]
    nodes: list[AgentStep] = field(default_factory=list)
    root_state: Any = field(default=None, repr=False, compare=False)

    def node(self, node_id: int) -> AgentStep:
        return self.nodes[node_id]

    def add(self, parent_id: int, **fields: Any) -> AgentStep:
        """Append a child of ``parent_id`` (``ROOT`` for the prompt) and return it."""
        depth = 0 if parent_id == ROOT else self.nodes[parent_id].depth + 1
        node = AgentStep(node_id=len(self.nodes), parent_id=parent_id, depth=depth, **fields)
        self.nodes.append(node)
        return node

    def leaves(self) -> list[AgentStep]:
        return [n for n in self.nodes if n.finished]

    def expandable(self) -> list[int]:
        """Node ids a new branch may start from: the root (``ROOT``) and every non-leaf node."""
        return [ROOT] + [n.node_id for n in self.nodes if not n.finished]

    def path(self, node_id: int) -> list[AgentStep]:
        """Nodes from the root's child down to ``node_id`` (inclusive); empty for ``ROOT``."""
        path = []
        while node_id != ROOT:
            node = self.nodes[node_id]
            path.append(node)
            node_id = node.parent_id
        return path[::-1]

    @property
    def token_count(self) -> int:
        """Prompt tokens plus every node's tokens: the tree's length packed whole."""
        return len(self.prompt_ids) + sum(node.token_count for node in self.nodes)

    def path_token_count(self, node_id: int) -> int:
        """Prompt tokens plus those of the path down to ``node_id``: that chain laid out flat."""
        return len(self.prompt_ids) + sum(node.token_count for node in self.path(node_id))

    def prefix_ids(self, node_id: int) -> list[int]:
        """Token ids a continuation of ``node_id`` is conditioned on: prompt + path tokens."""
        ids = list(self.prompt_ids)
        for node in self.path(node_id):
            ids += node.action_ids + node.obs_ids
        return ids

    def state_at(self, node_id: int) -> Any:
        return self.root_state if node_id == ROOT else self.nodes[node_id].env_state

    def keep_leaves(self, leaf_ids: set[int]) -> None:
        """Prune every node that is not on a path to one of ``leaf_ids``; renumber in order."""
        keep: set[int] = set()
        for leaf_id in leaf_ids:
            keep.update(n.node_id for n in self.path(leaf_id))
        new_ids = {old: new for new, old in enumerate(sorted(keep))}
        kept = [self.nodes[old] for old in sorted(keep)]
        for node in kept:
            node.node_id = new_ids[node.node_id]
            node.parent_id = ROOT if node.parent_id == ROOT else new_ids[node.parent_id]
        self.nodes = kept


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share (token ids, or node ids along two paths)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def trees_to_arrow(trees: list[Tree], info: BatchInfo | None) -> pa.Table:
    """Serialise trees to one Arrow table, one row per node (DESIGN §3), with ``info`` in the
    schema metadata under ``treegrpo`` (None: no metadata, e.g. for saved trees)."""
    columns: dict[str, list[Any]] = {name: [] for name in NODE_SCHEMA.names}
    for tree in trees:
        if not tree.nodes:
            raise ValueError(f"tree {tree.tree_id} has no nodes; only expanded trees can be sent")
        for node in tree.nodes:
            columns["tree_id"].append(tree.tree_id)
            columns["group_id"].append(tree.group_id)
            columns["prompt_ids"].append(tree.prompt_ids if node.node_id == 0 else None)
            for name in NODE_COLUMNS:
                columns[name].append(getattr(node, name))
    schema = (
        NODE_SCHEMA if info is None else NODE_SCHEMA.with_metadata({"treegrpo": info.to_json()})
    )
    return pa.Table.from_pydict(columns, schema=schema)


def trees_from_arrow(table: pa.Table) -> list[Tree]:
    """Inverse of ``trees_to_arrow`` (environment states are not carried)."""
    trees: dict[int, Tree] = {}
    for row in table.to_pylist():
        tree_id = row.pop("tree_id")
        group_id = row.pop("group_id")
        prompt_ids = row.pop("prompt_ids")
        if tree_id not in trees:
            if prompt_ids is None:
                raise ValueError(f"tree {tree_id}: its first row does not carry the prompt ids")
            trees[tree_id] = Tree(tree_id=tree_id, group_id=group_id, prompt_ids=prompt_ids)
        tree = trees[tree_id]
        if row["node_id"] != len(tree.nodes):
            raise ValueError(f"tree {tree_id}: node {row['node_id']} arrived out of order")
        tree.nodes.append(AgentStep(**row))
    return list(trees.values())


def batch_info(table: pa.Table) -> BatchInfo:
    """The ``BatchInfo`` given to ``trees_to_arrow``."""
    raw = (table.schema.metadata or {}).get(b"treegrpo")
    if raw is None:
        raise ValueError(
            "this Arrow table carries no tree-batch info; write it with trees_to_arrow"
        )
    return BatchInfo.from_json(raw.decode())
