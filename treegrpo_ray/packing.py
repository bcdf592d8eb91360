"""Turn trees into model inputs.

``expand_paths`` is the reference layout the paper's code trains on: one right-padded row per
root-to-leaf path (prompt + every node's action and observation tokens), with the loss on action
tokens only. Shared prefixes are repeated once per leaf below them.

``pack_trees`` is the layout the learner trains on: each unique token once, whole trees packed into
rows of at most ``micro_batch_tokens`` tokens, with a tree attention mask and path position ids
so that every token sees exactly the context it has on its own path.

How the mask reaches the model (checked in transformers 5.20.2): ``create_causal_mask`` in
``masking_utils`` returns a 4D ``attention_mask`` unchanged ("already prepared, or custom"), and
Qwen2 / Llama hand it to the attention function as is. ``eager`` adds it to the scores, so it must
be additive (a float 0 / large negative mask, in the model's dtype); ``sdpa`` passes it to
``torch.nn.functional.scaled_dot_product_attention`` as ``attn_mask``, which takes a boolean or an
additive mask and disables ``is_causal``. So ``PackedBatch.attention_bias`` (additive, finite
minimum as transformers' own eager masks) is exact for both; explicit ``position_ids`` feed the
rotary embeddings. Flash-attention and flex kernels do not take a dense 4D mask: load the model
with ``attn_implementation`` ``sdpa`` (the default) or ``eager``. A 4D mask is also used as is by
sliding-window layers, so models with sliding-window attention would lose their window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from treegrpo_ray.advantage import RoutedAdvantages, route_to_nodes
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.modifiers import NodeModifiers
from treegrpo_ray.tree import ROOT, Tree


@dataclass
class PathBatch:
    """One row per leaf. T is the longest path; targets are ``input_ids[:, 1:]``.

    input_ids: (B, T) long, right-padded with ``pad_token_id``.
    attention_mask: (B, T) long, 1 on real tokens.
    loss_mask: (B, T-1) float, 1 where the target token is an action token.
    behaviour_logprobs: (B, T-1) float, the engine's log-prob of each action target (0 elsewhere).
    rewards, tree_ids, group_ids, policy_version: (B,) per leaf.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    rewards: torch.Tensor
    tree_ids: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> PathBatch:
        """The sub-batch of the given row indices (all fields indexed alike)."""
        return PathBatch(**{name: value[rows] for name, value in vars(self).items()})


def expand_paths(trees: list[Tree], pad_token_id: int) -> PathBatch:
    """Path-expanded batch of every leaf of ``trees``."""
    rows: list[tuple[list[int], list[float], list[float]]] = []
    leaf_info = []
    for tree in trees:
        for leaf in tree.leaves():
            ids, is_action, logprobs = (
                list(tree.prompt_ids),
                [0.0] * len(tree.prompt_ids),
                [0.0] * len(tree.prompt_ids),
            )
            for node in tree.path(leaf.node_id):
                ids += node.action_ids + node.obs_ids
                is_action += [1.0] * len(node.action_ids) + [0.0] * len(node.obs_ids)
                logprobs += list(node.action_logprobs) + [0.0] * len(node.obs_ids)
            rows.append((ids, is_action, logprobs))
            leaf_info.append((leaf.reward, tree.tree_id, tree.group_id, leaf.policy_version))
    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width))
    behaviour = torch.zeros((len(rows), width))
    for i, (ids, is_action, logprobs) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(is_action)
        behaviour[i, : len(ids)] = torch.tensor(logprobs)
    rewards, tree_ids, group_ids, versions = zip(*leaf_info, strict=True)
    return PathBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask[:, 1:],
        behaviour_logprobs=behaviour[:, 1:],
        rewards=torch.tensor(rewards, dtype=torch.float32),
        tree_ids=torch.tensor(tree_ids),
        group_ids=torch.tensor(group_ids),
        policy_version=torch.tensor(versions),
    )


@dataclass
class PackedBatch:
    """Trees packed into R rows of width T, each unique token once; each row is one micro-batch,
    forwarded without its padding.

    Within a row every tree lies in one contiguous span: its prompt, then its nodes in creation
    order (a parent before its children), each node's action tokens followed by its observation
    tokens; rows are right-padded with ``pad_token_id`` to the longest row (at most the budget).
    A token is indexed by its own position t: ``prev_index[t]`` is where the token before it on
    its root-to-leaf path sits, so the logits at ``prev_index[t]`` predict token t. For the first
    token of a node that is the last token of its parent (or of the prompt), not t - 1.

    input_ids: (R, T) long.
    position_ids: (R, T) long, the token's position along its own root-to-leaf path (0 on padding).
    token_mask: (R, T) long, 1 on real tokens, 0 on padding.
    tree_mask: (R, T, T) bool, True where query token i may attend to key token j: j belongs to
        i's tree and is in the prompt, in an ancestor node of i's node, or in i's node at or
        before i. A padding token attends only to itself (no row of the mask is empty).
    prev_index: (R, T) long, see above; t itself where there is no predecessor (first prompt
        token, padding).
    loss_mask: (R, T) float, 1 on action tokens.
    behaviour_logprobs: (R, T) float, the engine's log-prob of each action token (0 elsewhere).
    token_node: (R, T) long, the token's node as an index into the batch's nodes (trees in
        order, then node ids), -1 on prompt and padding tokens.
    node_leaves: (N, L) float, 1 where leaf l is node n or lies below it.
    node_depths: (N,) long, each node's ``AgentStep.depth``; node_versions: (N,) long, the policy
        version that generated it; node_roles: N role names.
    rewards, tree_ids, group_ids, policy_version, leaf_depths: (L,) per leaf, in the order of
        ``expand_paths``.
    path_tokens: tokens path expansion would forward: the sum of the path lengths (no padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_mask: torch.Tensor
    tree_mask: torch.Tensor
    prev_index: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    token_node: torch.Tensor
    node_leaves: torch.Tensor
    node_depths: torch.Tensor
    node_versions: torch.Tensor
    node_roles: list[str]
    rewards: torch.Tensor
    tree_ids: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor
    leaf_depths: torch.Tensor
    path_tokens: int

    def stale_actions(self, version: int) -> torch.Tensor:
        """(R, T) bool: action tokens sampled by a policy older than ``version``."""
        token_version = self.node_versions[self.token_node.clamp(min=0)]
        return (self.loss_mask > 0) & (self.token_node >= 0) & (token_version < version)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def row_length(self, row: int) -> int:
        """Real tokens of ``row``: they come first, padding after them."""
        return int(self.token_mask[row].sum())

    def attention_bias(self, row: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (1, 1, n, n) over the n real tokens of ``row``: 0 where ``tree_mask``
        allows attention, the dtype's lowest finite value elsewhere."""
        n = self.row_length(row)
        allowed = self.tree_mask[row, None, None, :n, :n]
        bias = torch.zeros(allowed.shape, dtype=dtype)
        return bias.masked_fill(~allowed, torch.finfo(dtype).min)

    def route_nodes(
        self,
        leaf_advantages: torch.Tensor,
        mode: Literal["paper", "mean"],
        modifiers: NodeModifiers | None = None,
    ) -> RoutedAdvantages:
        """Leaf advantages (L,) routed to the nodes (``advantage.route_to_nodes``) and changed by
        the per-node ``modifiers`` if any: advantages and leaves (K, N), weights (N,), with
        modifiers also kl_coef and entropy_coef (N,)."""
        nodes = route_to_nodes(leaf_advantages, self.node_leaves, mode)
        if modifiers is not None:
            nodes = modifiers.apply(nodes, self.node_depths, self.node_roles)
        return nodes

    def route(
        self,
        leaf_advantages: torch.Tensor,
        mode: Literal["paper", "mean"],
        modifiers: NodeModifiers | None = None,
    ) -> RoutedAdvantages:
        """``route_nodes`` gathered onto the nodes' tokens: advantages and leaves (K, R, T),
        weights (R, T), with modifiers also kl_coef and entropy_coef (R, T); 0 on prompt and
        padding tokens."""
        return self.route_nodes(leaf_advantages, mode, modifiers).on_tokens(self.token_node)


@dataclass
class _TreeTokens:
    """One tree's unique tokens in packing order, with tree-local indices.

    ``prev`` holds tree-local positions; ``segment`` is 0 on the prompt and node_id + 1 on a
    node's tokens; ``visible[s, s']`` says segment s may attend to segment s' (s' is the prompt,
    an ancestor of s or s itself).
    """

    ids: list[int]
    positions: list[int]
    prev: list[int]
    is_action: list[float]
    logprobs: list[float]
    segment: list[int]
    visible: torch.Tensor


def _tree_tokens(tree: Tree) -> _TreeTokens:
    """Lay out one tree: prompt, then every node's action + observation tokens."""
    if not tree.prompt_ids:
        raise ValueError(
            f"tree {tree.tree_id} has an empty prompt; nothing predicts its first action"
        )
    prompt = len(tree.prompt_ids)
    out = _TreeTokens(
        ids=list(tree.prompt_ids),
        positions=list(range(prompt)),
        prev=[0, *range(prompt - 1)],
        is_action=[0.0] * prompt,
        logprobs=[0.0] * prompt,
        segment=[0] * prompt,
        visible=torch.eye(len(tree.nodes) + 1, dtype=torch.bool),
    )
    out.visible[:, 0] = True
    last = {ROOT: prompt - 1}  # tree-local position of the last token up to and including a node
    path_length = {ROOT: prompt}
    for node in tree.nodes:
        start, first_pos = len(out.ids), path_length[node.parent_id]
        tokens = node.action_ids + node.obs_ids
        out.ids += tokens
        out.positions += range(first_pos, first_pos + len(tokens))
        out.prev += [last[node.parent_id], *range(start, start + len(tokens) - 1)][: len(tokens)]
        out.is_action += [1.0] * len(node.action_ids) + [0.0] * len(node.obs_ids)
        out.logprobs += list(node.action_logprobs) + [0.0] * len(node.obs_ids)
        out.segment += [node.node_id + 1] * len(tokens)
        last[node.node_id] = start + len(tokens) - 1 if tokens else last[node.parent_id]
        path_length[node.node_id] = first_pos + len(tokens)
        if node.parent_id != ROOT:
            out.visible[node.node_id + 1] |= out.visible[node.parent_id + 1]
    return out


def _assign_rows(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of ``sizes`` split into as few rows of at most ``budget`` as longest-first
    balancing finds: each item, largest first, goes to the least-loaded row; one more row when it
    does not fit there. Each row's indices are in ascending order."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    count = max(1, math.ceil(sum(sizes) / budget))
    while True:
        rows: list[list[int]] = [[] for _ in range(count)]
        loads = [0] * count
        for i in order:
            r = loads.index(min(loads))
            if loads[r] + sizes[i] > budget:
                break
            rows[r].append(i)
            loads[r] += sizes[i]
        else:
            return [sorted(row) for row in rows if row]
        count += 1


def pack_trees(trees: list[Tree], micro_batch_tokens: int, pad_token_id: int) -> PackedBatch:
    """Pack whole trees into rows of at most ``micro_batch_tokens`` unique tokens.

    Raises ValueError for a tree that alone exceeds the budget (trees are never split or
    truncated): raise ``micro_batch_tokens`` or shorten the episodes.
    """
    laid_out = [_tree_tokens(tree) for tree in trees]
    for tree, tokens in zip(trees, laid_out, strict=True):
        if len(tokens.ids) > micro_batch_tokens:
            raise UserInputError(
                f"tree {tree.tree_id} has {len(tokens.ids)} tokens but ppo.micro_batch_tokens is "
                f"{micro_batch_tokens}; a tree is never split or truncated, so raise "
                "ppo.micro_batch_tokens to at least the largest tree"
            )
    rows = _assign_rows([len(t.ids) for t in laid_out], micro_batch_tokens)
    node_offset = [0]
    for tree in trees:
        node_offset.append(node_offset[-1] + len(tree.nodes))
    width = max(sum(len(laid_out[i].ids) for i in row) for row in rows)
    shape = (len(rows), width)
    batch = PackedBatch(
        input_ids=torch.full(shape, pad_token_id, dtype=torch.long),
        position_ids=torch.zeros(shape, dtype=torch.long),
        token_mask=torch.zeros(shape, dtype=torch.long),
        tree_mask=torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1),
        prev_index=torch.arange(width).repeat(len(rows), 1),
        loss_mask=torch.zeros(shape),
        behaviour_logprobs=torch.zeros(shape),
        token_node=torch.full(shape, -1, dtype=torch.long),
        **_leaf_fields(trees),
    )
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            tokens, span = laid_out[i], slice(start, start + len(laid_out[i].ids))
            segment = torch.tensor(tokens.segment)
            batch.input_ids[r, span] = torch.tensor(tokens.ids)
            batch.position_ids[r, span] = torch.tensor(tokens.positions)
            batch.token_mask[r, span] = 1
            batch.tree_mask[r, span, span] = tokens.visible[
                segment[:, None], segment[None, :]
            ].tril()
            batch.prev_index[r, span] = torch.tensor(tokens.prev) + start
            batch.loss_mask[r, span] = torch.tensor(tokens.is_action)
            batch.behaviour_logprobs[r, span] = torch.tensor(tokens.logprobs)
            batch.token_node[r, span] = torch.where(segment > 0, segment - 1 + node_offset[i], -1)
            start = span.stop
    return batch


def _leaf_fields(trees: list[Tree]) -> dict:
    """The per-node fields, the per-leaf fields and ``path_tokens`` of ``PackedBatch``."""
    leaves = [(tree, leaf) for tree in trees for leaf in tree.leaves()]
    nodes = [(tree, node.node_id) for tree in trees for node in tree.nodes]
    index = {(id(tree), node_id): n for n, (tree, node_id) in enumerate(nodes)}
    node_leaves = torch.zeros(len(nodes), len(leaves))
    path_tokens = 0
    for col, (tree, leaf) in enumerate(leaves):
        path = tree.path(leaf.node_id)
        path_tokens += len(tree.prompt_ids) + sum(node.token_count for node in path)
        for node in path:
            node_leaves[index[(id(tree), node.node_id)], col] = 1.0
    return dict(
        node_leaves=node_leaves,
        node_depths=torch.tensor([tree.node(n).depth for tree, n in nodes], dtype=torch.long),
        node_versions=torch.tensor(
            [tree.node(n).policy_version for tree, n in nodes], dtype=torch.long
        ),
        node_roles=[tree.node(n).role for tree, n in nodes],
        rewards=torch.tensor([leaf.reward for _, leaf in leaves], dtype=torch.float32),
        tree_ids=torch.tensor([tree.tree_id for tree, _ in leaves]),
        group_ids=torch.tensor([tree.group_id for tree, _ in leaves]),
        policy_version=torch.tensor([leaf.policy_version for _, leaf in leaves]),
        leaf_depths=torch.tensor([leaf.depth for _, leaf in leaves], dtype=torch.long),
        path_tokens=path_tokens,
    )
