"""Turn trees into model inputs.

``expand_paths`` is the reference layout the paper's code trains on: one right-padded row per
root-to-leaf path (prompt + every node's action and observation tokens), with the loss on action
tokens only. Shared prefixes are repeated once per leaf below them.

``pack_trees`` is the layout the learner trains on: each unique token once, whole trees packed into
rows of at most ``micro_batch_tokens`` tokens, with a tree attention mask and path position ids
so that every token sees exactly the context it has on its own path. A tree larger than the
budget is split by subtree into pieces that repeat, as loss-free context, the prompt and the
ancestor tokens their nodes need: only those repeated tokens are forwarded more than once.

How the mask reaches the model (checked in transformers 5.20.2): ``create_causal_mask`` in
``masking_utils`` returns a 4D ``attention_mask`` (a tensor or a flex ``BlockMask``) unchanged
("already prepared, or custom"), and Qwen2 / Llama hand it to the attention function as is.
``eager`` adds it to the scores, so it must be additive (a float 0 / large negative mask, in the
model's dtype); ``sdpa`` passes it to ``torch.nn.functional.scaled_dot_product_attention`` as
``attn_mask``, which takes a boolean or an additive mask and disables ``is_causal``. So
``PackedBatch.attention_bias`` (additive, finite minimum as transformers' own eager masks) is
exact for both; explicit ``position_ids`` feed the rotary embeddings. ``tree_flex``
(``treegrpo_ray.tree_attention``) takes ``PackedBatch.flex_block_mask`` instead: the same tree
mask as a function of two token indices, never materialised (n² entries), whose blocks with no
allowed pair are skipped; ``tree_blocks`` takes ``PackedBatch.tree_block_plan`` (as the
forward's keyword ``tree_blocks``): the mask's blocks that have an allowed pair, chunk by chunk.
A 4D mask is also used as is by sliding-window layers, so models with sliding-window attention
would lose their window.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Literal

import torch

from treegrpo_ray.advantage import RoutedAdvantages, route_to_nodes
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.modifiers import NodeModifiers
from treegrpo_ray.tree import ROOT, Tree

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


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

    def to(self, device: torch.device | str) -> PathBatch:
        """The same batch with every tensor on ``device``."""
        return PathBatch(**{name: value.to(device) for name, value in vars(self).items()})


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


# Above this share of a row's n² (query, key) pairs, block-sparse tree attention runs the dense
# mask instead: on the SmolLM2 preset's packed trees (benchmarks/tree_block_attention.py, README),
# chunks keeping 0.41-0.56 of the pairs ran forward + backward in 0.72-0.90 of the dense time
# (0.49 and 0.61 on the shortest row, 545 tokens: 1.01).
DENSE_SHARE = 0.6


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, the dtype's lowest finite value elsewhere (as transformers' masks)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


def _seen_key_blocks(allowed: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Per chunk of ``block`` queries of the (n, n) mask ``allowed``: the key positions (long,
    ascending) of the ``block``-token key blocks where the chunk sees at least one pair."""
    n = allowed.shape[0]
    chunks = -(-n // block)
    padded = torch.nn.functional.pad(allowed, (0, chunks * block - n, 0, chunks * block - n))
    seen = padded.view(chunks, block, chunks, block).any(dim=3).any(dim=1)  # (C, C)
    positions = torch.arange(chunks * block, device=allowed.device).view(chunks, block)
    keys = [positions[seen[c]].flatten() for c in range(chunks)]
    return [k[k < n] for k in keys]


@dataclass(frozen=True)
class TreeBlockPlan:
    """A packed row's tree mask as chunks of consecutive queries, each over only the keys of
    the blocks it sees anything in: what block-sparse tree attention
    (``treegrpo_ray.tree_attention``) computes, chunk by chunk, instead of all n² pairs.

    Chunk c holds queries ``query_offsets[c]:query_offsets[c + 1]`` (q_c of them) and keys
    ``key_index[key_offsets[c]:key_offsets[c + 1]]`` (k_c token positions, ascending); its
    additive mask (q_c, k_c) is the next q_c * k_c entries of ``bias``, chunks in order.
    query_offsets, key_offsets: (C + 1,) long; key_index: (sum k_c,) long; bias: (sum q_c k_c,).
    """

    query_offsets: torch.Tensor
    key_offsets: torch.Tensor
    key_index: torch.Tensor
    bias: torch.Tensor


@dataclass
class PackedBatch:
    """Trees packed into R rows of width T, each unique token once (but the context of split
    trees); each row is one micro-batch, forwarded without its padding.

    Within a row every tree lies in one contiguous span: its prompt, then its nodes in creation
    order (a parent before its children), each node's action tokens followed by its observation
    tokens. A tree over the budget is split into pieces, each a span like a tree's that holds
    some of its nodes plus, as context, the prompt and those of their ancestors it does not
    train; context tokens carry no loss (``loss_mask`` 0, ``token_node`` -1), so every node's
    loss tokens appear exactly once in the batch. Rows are right-padded with ``pad_token_id`` to
    the longest row (at most the budget).
    A token is indexed by its own position t: ``prev_index[t]`` is where the token before it on
    its root-to-leaf path sits, so the logits at ``prev_index[t]`` predict token t. For the first
    token of a node that is the last token of its parent (or of the prompt), not t - 1.

    input_ids: (R, T) long.
    position_ids: (R, T) long, the token's position along its own root-to-leaf path (0 on padding).
    token_mask: (R, T) long, 1 on real tokens, 0 on padding.
    segment: (R, T) long, the token's segment in its row: a prompt, or a node of a tree (or of a
        piece), numbered from 1 across the row; 0 on padding.
    segment_visible: (R, S, S) bool, True where segment s may attend to segment s': s' is the
        prompt of s's tree, an ancestor node of s, or s itself; all False for segment 0.
    ``tree_mask`` (R, T, T), derived from the two: query token i may attend to key token j when
    ``segment_visible[seg(i), seg(j)]`` and j <= i, or j == i (a padding token attends only to
    itself, so no row of the mask is empty).
    prev_index: (R, T) long, see above; t itself where there is no predecessor (first prompt
        token, padding).
    loss_mask: (R, T) float, 1 on action tokens.
    behaviour_logprobs: (R, T) float, the engine's log-prob of each action token (0 elsewhere).
    token_node: (R, T) long, the token's node as an index into the batch's nodes (trees in
        order, then node ids), -1 on prompt, context and padding tokens.
    node_leaves: (N, L) float, 1 where leaf l is node n or lies below it.
    node_depths: (N,) long, each node's ``AgentStep.depth``; node_versions: (N,) long, the policy
        version that generated it; node_roles: N role names.
    rewards, tree_ids, group_ids, policy_version, leaf_depths: (L,) per leaf, in the order of
        ``expand_paths``.
    path_tokens: tokens path expansion would forward: the sum of the path lengths (no padding).
    split_trees: trees split into pieces; split_extra_tokens: tokens forwarded beyond the unique
        ones, the prompts and ancestor nodes repeated as context in the pieces.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_mask: torch.Tensor
    segment: torch.Tensor
    segment_visible: torch.Tensor
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
    split_trees: int
    split_extra_tokens: int

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch with every tensor on ``device`` (the learner's)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

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

    @property
    def tree_mask(self) -> torch.Tensor:
        """(R, T, T) bool: the dense tree mask of every row (see the class docstring)."""
        rows = torch.arange(self.num_rows, device=self.segment.device)[:, None, None]
        seen = self.segment_visible[rows, self.segment[:, :, None], self.segment[:, None, :]]
        itself = torch.eye(self.segment.shape[1], dtype=torch.bool, device=seen.device)
        return seen.tril() | itself

    def _allowed(self, row: int) -> torch.Tensor:
        """(n, n) bool: ``tree_mask`` over the n real tokens of ``row``."""
        n = self.row_length(row)
        segment = self.segment[row, :n]
        return self.segment_visible[row, segment[:, None], segment[None, :]].tril()

    def visible_pairs(self) -> int:
        """The (query, key) pairs ``tree_mask`` keeps over the rows' real tokens, each token's
        pair with itself included: the pairs attention needs, whatever its kernel computes."""
        return sum(int(self._allowed(row).sum()) for row in range(self.num_rows))

    def attention_bias(self, row: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (1, 1, n, n) over the n real tokens of ``row``: 0 where ``tree_mask``
        allows attention, the dtype's lowest finite value elsewhere."""
        return _additive(self._allowed(row), dtype)[None, None]

    def tree_block_plan(
        self, row: int, dtype: torch.dtype, block: int, dense_share: float = DENSE_SHARE
    ) -> TreeBlockPlan:
        """``row``'s tree mask cut into chunks of ``block`` queries, each with only the key
        blocks where it sees something (its ancestors' blocks; see ``TreeBlockPlan``). Where
        that leaves more than ``dense_share`` of the n² pairs, one chunk of all queries and
        keys: the dense mask, which the kernel then runs faster in one piece."""
        allowed = self._allowed(row)
        n = allowed.shape[0]
        query_starts = list(range(0, n, block))
        keys = _seen_key_blocks(allowed, block)
        pairs = sum(min(block, n - q) * len(k) for q, k in zip(query_starts, keys, strict=True))
        if pairs > dense_share * n * n:
            query_starts, keys = [0], [torch.arange(n, device=allowed.device)]
        ends = [*query_starts[1:], n]
        biases = [
            _additive(allowed[q:e, k], dtype).flatten()
            for q, e, k in zip(query_starts, ends, keys, strict=True)
        ]
        return TreeBlockPlan(
            query_offsets=torch.tensor([*query_starts, n]),
            key_offsets=torch.tensor([0, *[len(k) for k in keys]]).cumsum(0),
            key_index=torch.cat(keys),
            bias=torch.cat(biases),
        )

    def flex_block_mask(self, row: int) -> BlockMask:
        """``attention_bias`` of ``row`` as a flex-attention ``BlockMask`` (1, 1, n, n): the mask
        is a function of (query, key) that reads two segment ids and one entry of
        ``segment_visible``; its (n / 128)² block summary is all that is stored."""
        from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as BLOCK
        from torch.nn.attention.flex_attention import create_block_mask

        n = self.row_length(row)
        # mask_mod is also called on the positions that pad n to a whole block: segment 0 there
        padded = -(-n // BLOCK) * BLOCK
        segment = torch.zeros(padded, dtype=torch.long, device=self.segment.device)
        segment[:n] = self.segment[row, :n]
        visible = self.segment_visible[row]

        def tree_mask(batch, head, query, key):
            return visible[segment[query], segment[key]] & (key <= query)

        on_gpu = segment.device.type == "cuda"  # compiled there: no n² mask even for a moment
        return create_block_mask(
            tree_mask, None, None, n, n, device=segment.device, _compile=on_gpu
        )

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
    """One tree's unique tokens, or one piece of a split tree, in packing order, with tree-local
    indices.

    ``prev`` holds tree-local positions; ``segment`` is 0 on the prompt and node_id + 1 on a
    node's tokens; ``visible[s, s']`` says segment s may attend to segment s' (s' is the prompt,
    an ancestor of s or s itself). ``node`` is the node id on the tokens of the nodes this layout
    trains (loss tokens), -1 on the prompt and on context nodes (ancestors repeated in a piece).
    """

    ids: list[int]
    positions: list[int]
    prev: list[int]
    is_action: list[float]
    logprobs: list[float]
    segment: list[int]
    node: list[int]
    visible: torch.Tensor


def _tree_tokens(
    tree: Tree, nodes: list[int] | None = None, context: frozenset[int] = frozenset()
) -> _TreeTokens:
    """Lay out one tree: prompt, then every node's action + observation tokens in creation order.

    ``nodes`` (creation order, closed under ancestors) lays out only those nodes (a piece of a
    split tree); of them, the ``context`` nodes are there only for the others to attend to: their
    tokens carry no loss (``is_action`` 0, ``node`` -1).
    """
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
        node=[-1] * prompt,
        visible=torch.eye(len(tree.nodes) + 1, dtype=torch.bool),
    )
    out.visible[:, 0] = True
    last = {ROOT: prompt - 1}  # tree-local position of the last token up to and including a node
    path_length = {ROOT: prompt}
    for node in tree.nodes if nodes is None else [tree.node(n) for n in nodes]:
        start, first_pos = len(out.ids), path_length[node.parent_id]
        tokens = node.action_ids + node.obs_ids
        trained = node.node_id not in context
        out.ids += tokens
        out.positions += range(first_pos, first_pos + len(tokens))
        out.prev += [last[node.parent_id], *range(start, start + len(tokens) - 1)][: len(tokens)]
        out.is_action += [float(trained)] * len(node.action_ids) + [0.0] * len(node.obs_ids)
        out.logprobs += (
            list(node.action_logprobs) if trained else [0.0] * len(node.action_ids)
        ) + [0.0] * len(node.obs_ids)
        out.segment += [node.node_id + 1] * len(tokens)
        out.node += [node.node_id if trained else -1] * len(tokens)
        last[node.node_id] = start + len(tokens) - 1 if tokens else last[node.parent_id]
        path_length[node.node_id] = first_pos + len(tokens)
        if node.parent_id != ROOT:
            out.visible[node.node_id + 1] |= out.visible[node.parent_id + 1]
    return out


def _path_lengths(tree: Tree) -> list[int]:
    """Per node: the tokens of its root-to-node path, prompt included."""
    lengths: list[int] = []
    for node in tree.nodes:
        before = len(tree.prompt_ids) if node.parent_id == ROOT else lengths[node.parent_id]
        lengths.append(before + node.token_count)
    return lengths


def _units(tree: Tree, budget: int) -> list[list[int]]:
    """The nodes of a tree over ``budget`` cut into units, in depth-first order: a child of the
    root or of a cut node whose whole subtree fits in ``budget`` with its path above is one unit
    (the subtree's nodes); one that does not is cut: it is a unit alone and its children are cut
    into units in turn. A unit's first node is its top; every unit is at most ``budget`` tokens
    with its path above, given that no path is longer than ``budget``."""
    children: dict[int, list[int]] = {ROOT: []}
    subtree = [node.token_count for node in tree.nodes]
    for node in tree.nodes:
        children[node.node_id] = []
        children[node.parent_id].append(node.node_id)
    for node in reversed(tree.nodes):
        if node.parent_id != ROOT:
            subtree[node.parent_id] += subtree[node.node_id]
    lengths = _path_lengths(tree)

    def below(top: int) -> list[int]:
        return [top] + [n for child in children[top] for n in below(child)]

    def cut(parent: int) -> list[list[int]]:
        units = []
        for child in children[parent]:
            above = lengths[child] - tree.node(child).token_count  # prompt + ancestors
            if above + subtree[child] <= budget:
                units.append(below(child))
            else:
                units += [[child], *cut(child)]
        return units

    return cut(ROOT)


def _split_tree(tree: Tree, budget: int) -> list[tuple[list[int], frozenset[int]]]:
    """Pieces of a tree over ``budget``, each at most ``budget`` tokens with its context: the
    units (``_units``), in depth-first order, each into the first piece it fits in; a unit costs
    its own tokens plus those of its ancestors the piece does not hold yet, which join the piece
    as context. Returns per piece its nodes (creation order) and its context nodes."""
    tokens = [node.token_count for node in tree.nodes]

    def size(nodes: set[int]) -> int:
        return len(tree.prompt_ids) + sum(tokens[n] for n in nodes)

    pieces: list[tuple[set[int], set[int]]] = []  # per piece: its nodes, its context nodes
    for unit in _units(tree, budget):
        above = {node.node_id for node in tree.path(unit[0])[:-1]}
        fits = [piece for piece in pieces if size(piece[0] | above | set(unit)) <= budget]
        if not fits:
            pieces.append((set(), set()))
        nodes, context = fits[0] if fits else pieces[-1]
        context |= above - nodes
        nodes |= above | set(unit)
    return [(sorted(nodes), frozenset(context)) for nodes, context in pieces]


def _lay_out(trees: list[Tree], budget: int) -> list[tuple[int, _TreeTokens]]:
    """(tree index, layout) of every tree that fits in ``budget`` whole, and of every piece of
    each one that does not (``_split_tree``), trees in order.

    Raises UserInputError when a root-to-leaf path alone exceeds ``budget``: a path is never
    split or truncated, so ``budget`` must be at least the longest path.
    """
    lengths = [max(_path_lengths(tree), default=len(tree.prompt_ids)) for tree in trees]
    longest = max(range(len(trees)), key=lambda i: lengths[i])
    if lengths[longest] > budget:
        raise UserInputError(
            f"tree {trees[longest].tree_id} has a root-to-leaf path of {lengths[longest]} tokens "
            f"but ppo.micro_batch_tokens is {budget}; a path is never split or truncated, so "
            f"raise ppo.micro_batch_tokens to at least {lengths[longest]} or shorten the episodes"
        )
    out: list[tuple[int, _TreeTokens]] = []
    for i, tree in enumerate(trees):
        whole = _tree_tokens(tree)
        if len(whole.ids) <= budget:
            out.append((i, whole))
        else:
            out += [(i, _tree_tokens(tree, *piece)) for piece in _split_tree(tree, budget)]
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


def pack_trees(
    trees: list[Tree], micro_batch_tokens: int, pad_token_id: int, one_tree_per_row: bool = False
) -> PackedBatch:
    """Pack trees into rows of at most ``micro_batch_tokens`` tokens.

    A tree that fits is packed whole. A tree that does not is split by subtree into pieces
    (``_split_tree``); each piece repeats the prompt and the ancestor nodes its nodes need as
    context, with no loss on them, so every node's loss tokens are still counted exactly once and
    the loss equals the unsplit tree's. Trees (and pieces) share rows, as few as they fit in,
    unless ``one_tree_per_row``: then each gets a row of its own (under a dense mask, trees in
    one row pay for every pair of their tokens across trees). Raises UserInputError when a
    root-to-leaf path alone exceeds the budget (``_lay_out``).
    """
    laid_out = _lay_out(trees, micro_batch_tokens)
    if one_tree_per_row:
        rows = [[i] for i in range(len(laid_out))]
    else:
        rows = _assign_rows([len(t.ids) for _, t in laid_out], micro_batch_tokens)
    node_offset = [0]
    for tree in trees:
        node_offset.append(node_offset[-1] + len(tree.nodes))
    unique = sum(tree.token_count for tree in trees)
    width = max(sum(len(laid_out[i][1].ids) for i in row) for row in rows)
    segments = max(1 + sum(len(laid_out[i][1].visible) for i in row) for row in rows)
    shape = (len(rows), width)
    batch = PackedBatch(
        input_ids=torch.full(shape, pad_token_id, dtype=torch.long),
        position_ids=torch.zeros(shape, dtype=torch.long),
        token_mask=torch.zeros(shape, dtype=torch.long),
        segment=torch.zeros(shape, dtype=torch.long),
        segment_visible=torch.zeros((len(rows), segments, segments), dtype=torch.bool),
        prev_index=torch.arange(width).repeat(len(rows), 1),
        loss_mask=torch.zeros(shape),
        behaviour_logprobs=torch.zeros(shape),
        token_node=torch.full(shape, -1, dtype=torch.long),
        split_trees=sum(count > 1 for count in Counter(i for i, _ in laid_out).values()),
        split_extra_tokens=sum(len(t.ids) for _, t in laid_out) - unique,
        **_leaf_fields(trees),
    )
    for r, row in enumerate(rows):
        start, first_segment = 0, 1
        for item in row:
            i, tokens = laid_out[item]
            span = slice(start, start + len(tokens.ids))
            segment, node = torch.tensor(tokens.segment), torch.tensor(tokens.node)
            batch.input_ids[r, span] = torch.tensor(tokens.ids)
            batch.position_ids[r, span] = torch.tensor(tokens.positions)
            batch.token_mask[r, span] = 1
            own = slice(first_segment, first_segment + len(tokens.visible))
            batch.segment[r, span] = segment + first_segment
            batch.segment_visible[r, own, own] = tokens.visible
            batch.prev_index[r, span] = torch.tensor(tokens.prev) + start
            batch.loss_mask[r, span] = torch.tensor(tokens.is_action)
            batch.behaviour_logprobs[r, span] = torch.tensor(tokens.logprobs)
            batch.token_node[r, span] = torch.where(node >= 0, node + node_offset[i], -1)
            start, first_segment = span.stop, own.stop
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
        path_tokens += tree.path_token_count(leaf.node_id)
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
