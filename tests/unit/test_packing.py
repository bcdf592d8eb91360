"""Tree packing against the path-expanded reference layout: structure, log-probs, loss, gradients."""

import math
import random

import pytest
import torch

from treegrpo_ray.advantage import route_to_nodes
from treegrpo_ray.config import PPOConfig, TinyModelConfig
from treegrpo_ray.learners.forward import packed_logprobs, token_logprobs
from treegrpo_ray.loss import PPOCoefficients, ppo_loss, routed_ppo_loss
from treegrpo_ray.modeling import build_tiny_model
from treegrpo_ray.packing import PackedBatch, expand_paths, pack_trees
from treegrpo_ray.tree import ROOT, Tree
from treegrpo_ray.tree_attention import TREE_BLOCKS, TREE_FLEX

VOCAB = 40
COMMON = dict(policy_version=0, role="search", tool_call=False, finish_reason="stop")


def _hand_tree():
    # prompt [1, 2]; root -> a (action [3, 4], obs [5]) -> b (action [6], leaf, R = 1.0)
    #                     -> c (action [7, 8], leaf, R = 0.2)
    tree = Tree(tree_id=0, group_id=0, prompt_ids=[1, 2])
    tree.add(
        ROOT, action_ids=[3, 4], action_logprobs=[-0.1, -0.2], obs_ids=[5], finished=False, **COMMON
    )
    tree.add(
        0, action_ids=[6], action_logprobs=[-0.3], obs_ids=[], finished=True, reward=1.0, **COMMON
    )
    tree.add(
        ROOT,
        action_ids=[7, 8],
        action_logprobs=[-0.4, -0.5],
        obs_ids=[],
        finished=True,
        reward=0.2,
        **COMMON,
    )
    return tree


def _random_tree(rng, tree_id, group_id, depth, branches):
    """A seed chain of ``depth`` nodes, then ``branches`` branches from random non-leaf nodes
    (or the root), each completed to ``depth``; some nodes have no action or observation tokens."""
    tree = Tree(tree_id, group_id, [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))])

    def grow(parent):
        while True:
            level = 0 if parent == ROOT else tree.node(parent).depth + 1
            done = level == depth - 1
            action = [rng.randrange(3, VOCAB) for _ in range(rng.choice([0, 1, 2, 3, 4]))]
            node = tree.add(
                parent,
                action_ids=action,
                action_logprobs=[-rng.random() for _ in action],
                obs_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 6))],
                finished=done,
                reward=float(rng.randint(0, 1)) if done else float("nan"),
                **COMMON,
            )
            if done:
                return
            parent = node.node_id

    grow(ROOT)
    for _ in range(branches):
        grow(rng.choice(tree.expandable()))
    return tree


def _forest(seed, trees=3, depth=3, branches=2):
    rng = random.Random(seed)
    return [_random_tree(rng, i, i // 2, depth, branches) for i in range(trees)]


def _model(seed, attention="sdpa"):
    cfg = TinyModelConfig(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    model = build_tiny_model(cfg, vocab_size=VOCAB, seed=seed)
    model.set_attn_implementation(attention)
    return model


def _packed_positions(trees, batch: PackedBatch):
    """For every leaf (expand_paths order): the packed (row, t) of its path's action tokens."""
    first_node, offset = [], 0
    for tree in trees:
        first_node.append(offset)
        offset += len(tree.nodes)
    out = []
    for i, tree in enumerate(trees):
        for leaf in tree.leaves():
            spots = []
            for node in tree.path(leaf.node_id):
                on_node = (
                    batch.token_node == first_node[i] + node.node_id
                ) & batch.loss_mask.bool()
                spots += on_node.nonzero().tolist()
            out.append(spots)
    return out


def _on_paths(packed_values, positions):
    """Packed values (R, T) laid out like the path batch's action tokens, concatenated."""
    return torch.cat([packed_values[[r for r, _ in p], [t for _, t in p]] for p in positions])


def _all_rows(fn, batch):
    parts = [fn(r) for r in range(batch.num_rows)]
    return [torch.stack(values) for values in zip(*parts, strict=True)]


def test_pack_lays_out_one_tree_with_path_positions_and_predecessors():
    batch = pack_trees([_hand_tree()], micro_batch_tokens=16, pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    # c's tokens 7, 8 sit at path positions 2, 3 (right after the prompt), not 6, 7
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3]]
    # 7 is predicted from the prompt's last token 2 (position 1), not from 6 (position 5)
    assert batch.prev_index.tolist() == [[0, 0, 1, 2, 3, 4, 1, 6]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1, 1, 1]]
    assert batch.token_node.tolist() == [[-1, -1, 0, 0, 0, 1, 2, 2]]
    torch.testing.assert_close(
        batch.behaviour_logprobs, torch.tensor([[0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5]])
    )
    expected_mask = [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],  # a sees the prompt and itself
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],  # b sees the prompt and its parent a
        [1, 1, 0, 0, 0, 0, 1, 0],  # c sees the prompt only, not its sibling branch a -> b
        [1, 1, 0, 0, 0, 0, 1, 1],
    ]
    assert batch.tree_mask.int().tolist() == [expected_mask]
    assert batch.visible_pairs() == 28  # the ones above
    # leaves b, c; node a lies above b only
    assert batch.node_leaves.tolist() == [[1, 0], [1, 0], [0, 1]]
    assert batch.path_tokens == 6 + 4


def test_pack_fills_rows_with_whole_trees_and_pads_to_the_longest_row():
    trees = _forest(0, trees=5)
    sizes = [t.token_count for t in trees]
    budget = max(sizes) + 5
    batch = pack_trees(trees, micro_batch_tokens=budget, pad_token_id=0)
    assert batch.num_rows > 1 and batch.input_ids.shape[1] <= budget
    assert int(batch.token_mask.sum()) == sum(sizes)
    # padding attends only to itself, and no real token attends to padding
    pad = batch.token_mask == 0
    assert torch.equal(
        batch.tree_mask[pad],
        torch.eye(batch.input_ids.shape[1]).bool()[None].expand_as(batch.tree_mask)[pad],
    )
    assert not bool((batch.tree_mask & pad[:, None, :] & ~pad[:, :, None]).any())
    # a tree's tokens see exactly what they see when the tree is packed alone: nothing across trees
    alone = [pack_trees([t], budget, pad_token_id=0) for t in trees]
    assert int((batch.tree_mask & ~pad[:, :, None]).sum()) == sum(
        int(one.tree_mask.sum()) for one in alone
    )
    assert batch.visible_pairs() == sum(one.visible_pairs() for one in alone)


def test_one_tree_per_row_gives_each_tree_and_each_piece_a_row_of_its_own():
    trees = _forest(1, trees=5)
    sizes = [t.token_count for t in trees]
    shared = pack_trees(trees, micro_batch_tokens=sum(sizes), pad_token_id=0)
    apart = pack_trees(trees, micro_batch_tokens=sum(sizes), pad_token_id=0, one_tree_per_row=True)
    assert shared.num_rows == 1
    assert apart.token_mask.sum(1).tolist() == sizes
    # split trees (this forest's longest path has 24 tokens, its trees 32-43): each piece in a
    # row of its own, the same tokens; shared, two pieces fit in one row of 30
    budget = 30
    split_shared = pack_trees(trees, budget, pad_token_id=0)
    split_apart = pack_trees(trees, budget, pad_token_id=0, one_tree_per_row=True)
    assert split_apart.split_trees > 0
    assert split_apart.num_rows > split_shared.num_rows
    assert int(split_apart.token_mask.sum()) == int(split_shared.token_mask.sum())


def _longest_path(trees):
    return max(len(tree.prefix_ids(leaf.node_id)) for tree in trees for leaf in tree.leaves())


def _unique_tokens(trees):
    return sum(t.token_count for t in trees)


def test_a_tree_over_the_budget_is_split_by_subtree_with_its_ancestors_as_context():
    # layout whole: [1, 2 | 3, 4, 5 (a) | 6 (b) | 7, 8 (c) | 9 (d)], 9 tokens; budget 6.
    # a's subtree (a, b, d) with the prompt is 7 > 6: a is cut. Units, depth first, with the
    # tokens above them: a (2), b (2 + 3 = 5), d (5), c (2). First fit: a, b -> piece 1
    # (2 + 3 + 1 = 6); d: piece 1 would be 7 -> piece 2 = prompt + a as context + d = 6;
    # c: 8 in piece 1, 8 in piece 2 -> piece 3 = prompt + c = 4.
    batch = pack_trees([_hand_tree_with_two_leaves_under_a()], micro_batch_tokens=6, pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9], [1, 2, 7, 8, 0, 0]]
    # a's tokens carry the loss in row 0 only; in row 1 they are context, like the prompt
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 1], [0, 0, 1, 1, 0, 0]]
    assert batch.token_node.tolist() == [
        [-1, -1, 0, 0, 0, 1],
        [-1, -1, -1, -1, -1, 3],
        [-1, -1, 2, 2, -1, -1],
    ]
    torch.testing.assert_close(batch.behaviour_logprobs[1], torch.tensor([0, 0, 0, 0, 0, -0.6]))
    assert batch.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3, 0, 0],
    ]
    # d (row 1, t = 5) is predicted from a's last token 5 (t = 4), as on its path
    assert batch.prev_index.tolist() == [[0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 4, 5]]
    assert batch.tree_mask[1].int().tolist() == torch.ones(6, 6).tril().int().tolist()
    # repeated: the prompt twice (rows 1 and 2) and a once (row 1): 2 + 2 + 3 = 7 tokens
    assert (batch.split_trees, batch.split_extra_tokens) == (1, 7)
    assert int(batch.token_mask.sum()) == 9 + 7


def test_a_path_over_the_budget_is_rejected_with_the_budget_it_needs():
    # the path prompt -> a -> b is [1, 2, 3, 4, 5, 6]: 6 tokens
    with pytest.raises(
        ValueError,
        match="tree 0 has a root-to-leaf path of 6 tokens but ppo.micro_batch_tokens is 5; .* "
        "raise ppo.micro_batch_tokens to at least 6",
    ):
        pack_trees([_hand_tree()], micro_batch_tokens=5, pad_token_id=0)


@pytest.mark.parametrize("seed", range(20))
def test_split_trees_train_each_node_once_and_trees_that_fit_stay_whole(seed):
    rng = random.Random(seed)
    trees = _forest(seed, trees=5, depth=rng.randint(2, 5), branches=rng.randint(1, 5))
    sizes = [t.token_count for t in trees]
    budget = rng.randint(_longest_path(trees), max(sizes) - 1)
    batch = pack_trees(trees, micro_batch_tokens=budget, pad_token_id=0)
    split = [size > budget for size in sizes]
    assert batch.input_ids.shape[1] <= budget and batch.split_trees == sum(split) > 0
    assert int(batch.token_mask.sum()) == _unique_tokens(trees) + batch.split_extra_tokens
    # every action token carries the loss exactly once, on its own node
    actions = torch.tensor([len(n.action_ids) for t in trees for n in t.nodes])
    trained = batch.token_node[batch.loss_mask.bool()]
    assert torch.equal(torch.bincount(trained, minlength=len(actions)), actions)
    # a tree that fits lies whole in one span of one row, laid out as when packed alone
    first_node = 0
    for tree, size, is_split in zip(trees, sizes, split, strict=True):
        on_tree = (batch.token_node >= first_node) & (
            batch.token_node < first_node + len(tree.nodes)
        )
        first_node += len(tree.nodes)
        if is_split:
            continue
        (row,), ts = on_tree.any(1).nonzero()[:, 0].tolist(), on_tree.nonzero()[:, 1].tolist()
        assert len(ts) == size - len(tree.prompt_ids) == ts[-1] + 1 - ts[0]  # contiguous
        start = ts[0] - len(tree.prompt_ids)
        span = slice(start, start + size)
        alone = pack_trees([tree], budget, pad_token_id=0)
        for field in ("input_ids", "position_ids", "loss_mask", "prev_index"):
            packed, own = getattr(batch, field)[row, span], getattr(alone, field)[0]
            offset = start if field == "prev_index" else 0
            assert torch.equal(packed, own + offset), field
        assert torch.equal(batch.tree_mask[row, span, span], alone.tree_mask[0])


@pytest.mark.parametrize("attention", ["sdpa", "eager", TREE_FLEX, TREE_BLOCKS])
@pytest.mark.parametrize(
    "seed,depth,branches,budget",
    # budget None: the longest path, which splits trees
    [(0, 1, 3, 64), (1, 3, 2, 48), (2, 4, 4, 512), (3, 2, 0, 40), (4, 4, 4, None), (5, 3, 2, None)],
)
def test_packed_logprobs_equal_path_by_path_logprobs(attention, seed, depth, branches, budget):
    trees = _forest(seed, trees=4, depth=depth, branches=branches)
    model = _model(seed, attention).eval()
    paths = expand_paths(trees, pad_token_id=0)
    packed = pack_trees(trees, micro_batch_tokens=budget or _longest_path(trees), pad_token_id=0)
    assert (packed.split_trees > 0) == (budget is None)
    with torch.no_grad():
        # the reference: one padded row per path, causal attention through sdpa
        reference = _model(seed, "sdpa").eval()
        path_lp, path_ent = token_logprobs(reference, paths.input_ids, paths.attention_mask, 0.7)
        lp, ent = _all_rows(lambda r: packed_logprobs(model, packed, r, 0.7), packed)
    mask = paths.loss_mask.bool()
    positions = _packed_positions(trees, packed)
    torch.testing.assert_close(_on_paths(lp, positions), path_lp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(_on_paths(ent, positions), path_ent[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        _on_paths(packed.behaviour_logprobs, positions), paths.behaviour_logprobs[mask]
    )


def _offset(input_ids, positions):
    """A fixed per-token shift of the old log-probs: ratios reach e^±1.5, so clipping and the
    dual clip both bind. It depends only on the token and its path position, as the old
    log-probs of one token do in either layout."""
    return 1.5 * torch.sin(7.0 * input_ids + 3.0 * positions)


def _path_loss(model, ref_model, trees, advantages, coef):
    paths = expand_paths(trees, pad_token_id=0)
    logprobs, entropy = token_logprobs(model, paths.input_ids, paths.attention_mask)
    with torch.no_grad():
        ref_logprobs, _ = token_logprobs(ref_model, paths.input_ids, paths.attention_mask)
    targets = paths.input_ids[:, 1:]
    old = logprobs.detach() + _offset(targets, torch.arange(1, targets.shape[1] + 1))
    token_advantages = advantages[:, None].expand_as(paths.loss_mask)
    # the example must exercise both clips: A > 0 with ratio > 1.2, A < 0 with ratio > 3
    ratio = torch.exp(logprobs.detach() - old)
    mask = paths.loss_mask.bool()
    assert bool((mask & (token_advantages > 0) & (ratio > 1.2)).any())
    assert bool((mask & (token_advantages < 0) & (ratio > 3)).any())
    return ppo_loss(logprobs, old, ref_logprobs, entropy, token_advantages, paths.loss_mask, coef)


def _packed_loss(model, ref_model, batch, routed, coef):
    """Row by row, as the learner does: each row's loss over the whole batch's denominator."""
    denominator = float((batch.loss_mask * routed.weights).sum())
    total, stats = 0.0, {}
    for r in range(batch.num_rows):
        logprobs, entropy = packed_logprobs(model, batch, r)
        with torch.no_grad():
            ref_logprobs, _ = packed_logprobs(ref_model, batch, r)
        old = logprobs.detach() + _offset(batch.input_ids[r], batch.position_ids[r])
        loss, row_stats = routed_ppo_loss(
            logprobs,
            old,
            ref_logprobs,
            entropy,
            routed.row(r),
            batch.loss_mask[r],
            denominator,
            coef,
        )
        loss.backward()
        total += loss.item()
        stats = {k: stats.get(k, 0.0) + v for k, v in row_stats.items()}
    return total, stats


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("seed,depth,branches", [(0, 3, 2), (1, 4, 3), (2, 2, 5)])
def test_paper_mode_loss_and_every_gradient_equal_the_path_expanded_ones(
    seed, depth, branches, split
):
    """Whole trees, or (``split``) trees split over a budget of the longest path."""
    trees = _forest(seed, trees=4, depth=depth, branches=branches)
    model, ref_model = _model(seed), _model(seed + 100).requires_grad_(False)
    coef = PPOCoefficients(
        clip_ratio=0.2, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.05, kl_clamp=True
    )
    leaves = sum(len(t.leaves()) for t in trees)
    advantages = torch.randn(leaves, generator=torch.Generator().manual_seed(seed)) * 2
    advantages[0] = 0.0  # a zero advantage counts in the token-mean but not in the clip fraction

    path_loss, path_stats = _path_loss(model, ref_model, trees, advantages, coef)
    path_loss.backward()
    path_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    budget = _longest_path(trees) if split else 80
    batch = pack_trees(trees, micro_batch_tokens=budget, pad_token_id=0)
    assert batch.num_rows > 1  # gradient accumulation over rows is part of what is checked
    assert (batch.split_trees > 0) == split
    loss, stats = _packed_loss(model, ref_model, batch, batch.route(advantages, "paper"), coef)

    assert loss == pytest.approx(path_loss.item(), abs=1e-5)
    for key, value in path_stats.items():
        assert stats[key] == pytest.approx(value, abs=1e-5), key
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, path_grads[name], atol=1e-5, rtol=0, msg=name)


def _hand_tree_with_two_leaves_under_a():
    # prompt [1, 2]; a (action [3, 4], obs [5]) -> b (action [6], leaf)
    #                                           -> d (action [9], leaf)
    #                c (action [7, 8], leaf)
    # layout [1, 2, 3, 4, 5, 6, 7, 8, 9]: nodes a = 0, b = 1, c = 2, d = 3; leaves b, c, d
    tree = _hand_tree()
    tree.add(
        0, action_ids=[9], action_logprobs=[-0.6], obs_ids=[], finished=True, reward=0.0, **COMMON
    )
    return tree


def test_paper_routing_carries_positive_and_negative_mass_and_leaf_counts():
    batch = pack_trees(
        [_hand_tree_with_two_leaves_under_a()], micro_batch_tokens=16, pad_token_id=0
    )
    nodes = route_to_nodes(torch.tensor([1.0, 0.5, -2.0]), batch.node_leaves, "paper")
    # a: leaves b (+1) and d (-2); b, c, d: themselves
    torch.testing.assert_close(
        nodes.advantages, torch.tensor([[1.0, 1.0, 0.5, 0.0], [-2.0, 0.0, 0.0, -2.0]])
    )
    torch.testing.assert_close(
        nodes.leaves, torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    )
    torch.testing.assert_close(nodes.weights, torch.tensor([2.0, 1.0, 1.0, 1.0]))


def test_mean_mode_matches_hand_computed_value():
    batch = pack_trees(
        [_hand_tree_with_two_leaves_under_a()], micro_batch_tokens=16, pad_token_id=0
    )
    # leaf advantages b = +1, c = +0.5, d = -2; mean mode: a -> (1 - 2) / 2 = -0.5
    routed = batch.route(torch.tensor([1.0, 0.5, -2.0]), "mean")
    torch.testing.assert_close(
        routed.advantages, torch.tensor([[[0, 0, -0.5, -0.5, -0.5, 1.0, 0.5, 0.5, -2.0]]])
    )
    # ratios: token 3 (a) 1.5, token 9 (d) 5.0, every other action token 1
    ratios = torch.tensor([[1.0, 1.0, 1.5, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]])
    logprobs, old = torch.log(ratios), torch.zeros(1, 9)
    entropy = torch.ones(1, 9)
    denominator = float((batch.loss_mask * routed.weights).sum())
    assert denominator == 6  # six unique action tokens, each once
    # pg per action token:
    #   3: r=1.5, A=-0.5: max(0.75, 0.6) = 0.75; dual min(0.75, 1.5) = 0.75
    #   4: r=1, A=-0.5: 0.5     6: A=+1: -1     7, 8: A=+0.5: -0.5 each
    #   9: r=5, A=-2: max(10, 2.4) = 10; dual min(10, 6) = 6   (dual clip)
    #   mean = (0.75 + 0.5 - 1 - 0.5 - 0.5 + 6) / 6 = 5.25 / 6 = 0.875
    # KL 0 (ref = logprobs); entropy mean 1; loss = 0.875 + 0 - 0.001 * 1 = 0.874
    loss, stats = routed_ppo_loss(
        logprobs,
        old,
        logprobs,
        entropy,
        routed,
        batch.loss_mask,
        denominator,
        PPOCoefficients.of(PPOConfig()),
    )
    assert loss.item() == pytest.approx(0.874, abs=1e-6)
    assert stats["learner/pg_loss"] == pytest.approx(0.875, abs=1e-6)
    assert stats["learner/entropy"] == pytest.approx(1.0, abs=1e-6)
    assert stats["learner/pg_clipfrac"] == pytest.approx(1 / 6, abs=1e-6)


def test_mean_mode_ignores_nodes_with_no_leaf_below():
    # node_leaves of a node that no path holds is all zero: weight 0, advantage 0
    nodes = route_to_nodes(torch.tensor([2.0]), torch.tensor([[1.0], [0.0]]), "mean")
    assert nodes.advantages.tolist() == [[2.0, 0.0]] and nodes.weights.tolist() == [1.0, 0.0]


def test_expand_paths_builds_one_row_per_leaf_with_action_only_loss():
    batch = expand_paths([_hand_tree()], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    # targets are input_ids[:, 1:]: [2, 3, 4, 5, 6] and [2, 7, 8, pad, pad]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]]
    expected = torch.tensor([[0, -0.1, -0.2, 0, -0.3], [0, -0.4, -0.5, 0, 0]])
    torch.testing.assert_close(batch.behaviour_logprobs, expected)
    torch.testing.assert_close(batch.rewards, torch.tensor([1.0, 0.2]))
    assert batch.tree_ids.tolist() == [0, 0]


def test_select_keeps_rows_aligned():
    batch = expand_paths([_hand_tree()], pad_token_id=0)
    sub = batch.select(torch.tensor([1]))
    assert sub.input_ids.tolist() == [[1, 2, 7, 8, 0, 0]]
    assert math.isclose(float(sub.rewards[0]), 0.2, rel_tol=1e-6)


@pytest.mark.parametrize("seed,budget", [(0, 64), (1, 200), (4, None)])
def test_the_flex_block_mask_is_the_dense_tree_mask(seed, budget):
    """The block mask's function of (query, key) allows exactly the pairs the dense mask does,
    on every row, across trees packed together and across split trees' pieces."""
    trees = _forest(seed, trees=4, depth=3, branches=3)
    batch = pack_trees(trees, budget or _longest_path(trees), pad_token_id=0)
    for row in range(batch.num_rows):
        n = batch.row_length(row)
        block_mask = batch.flex_block_mask(row)
        assert block_mask.shape == (1, 1, n, n)
        query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = block_mask.mask_mod(0, 0, query, key)
        assert torch.equal(allowed, batch.tree_mask[row, :n, :n])
        assert torch.equal(batch.attention_bias(row, torch.float32)[0, 0] == 0, allowed)


def test_flex_gives_the_dense_logprobs_with_three_query_heads_per_key_head():
    """Query heads per key head not a power of two (Qwen2.5-0.5B has 7): keys are repeated."""
    trees = _forest(6, trees=3, depth=3, branches=2)
    batch = pack_trees(trees, 256, pad_token_id=0)
    shape = TinyModelConfig(
        hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=64
    )
    logprobs = {}
    for attention in ("sdpa", TREE_FLEX):
        model = build_tiny_model(shape, vocab_size=VOCAB, seed=6).eval()
        model.set_attn_implementation(attention)
        with torch.no_grad():
            logprobs[attention] = _all_rows(lambda r, m=model: packed_logprobs(m, batch, r), batch)[
                0
            ]
    torch.testing.assert_close(logprobs[TREE_FLEX], logprobs["sdpa"], atol=1e-5, rtol=0)


def test_the_tree_block_plan_of_the_hand_tree_skips_its_hidden_blocks():
    """Blocks of 2 over the hand tree's 8 tokens (mask above): queries 6, 7 (node c) see the
    prompt's block and their own, not a -> b's blocks 1 and 2."""
    batch = pack_trees([_hand_tree()], micro_batch_tokens=16, pad_token_id=0)
    plan = batch.tree_block_plan(0, torch.float32, block=2)
    assert plan.query_offsets.tolist() == [0, 2, 4, 6, 8]
    assert plan.key_offsets.tolist() == [0, 2, 6, 12, 16]
    assert plan.key_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 6, 7]
    last_chunk = plan.bias[-8:].view(2, 4) == 0
    assert last_chunk.tolist() == [[True, True, True, False], [True, True, True, True]]
    # 32 of the 64 pairs: above a share of 0.4, the one dense chunk
    dense = batch.tree_block_plan(0, torch.float32, block=2, dense_share=0.4)
    assert dense.query_offsets.tolist() == [0, 8] and dense.key_offsets.tolist() == [0, 8]
    assert torch.equal(dense.bias.view(1, 1, 8, 8), batch.attention_bias(0, torch.float32))


def _plan_as_dense(plan, n):
    """The (n, n) pairs a ``TreeBlockPlan`` allows, every other pair False."""
    allowed = torch.zeros(n, n, dtype=torch.bool)
    queries, keys, start = plan.query_offsets.tolist(), plan.key_offsets.tolist(), 0
    for c in range(len(queries) - 1):
        rows = torch.arange(queries[c], queries[c + 1])
        cols = plan.key_index[keys[c] : keys[c + 1]]
        size = len(rows) * len(cols)
        allowed[rows[:, None], cols[None, :]] = (
            plan.bias[start : start + size].view(len(rows), len(cols)) == 0
        )
        start += size
    assert start == plan.bias.numel()
    return allowed


@pytest.mark.parametrize("seed,budget", [(0, 64), (2, 512), (5, None)])
def test_the_tree_block_plan_keeps_every_pair_of_the_dense_mask(seed, budget):
    """On every row (trees packed together, split trees' pieces), the chunks' keys and masks
    allow exactly the dense mask's pairs, while leaving out key blocks below the diagonal."""
    trees = _forest(seed, trees=4, depth=4, branches=4)
    batch = pack_trees(trees, budget or _longest_path(trees), pad_token_id=0)
    skipped_hidden_blocks = False
    for row in range(batch.num_rows):
        n = batch.row_length(row)
        plan = batch.tree_block_plan(row, torch.float32, block=8, dense_share=1.0)
        assert torch.equal(_plan_as_dense(plan, n), batch.tree_mask[row, :n, :n])
        causal_blocks = sum(min(8, n - q) * min(n, q + 8) for q in range(0, n, 8))
        skipped_hidden_blocks |= plan.bias.numel() < causal_blocks
    assert skipped_hidden_blocks


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_block_attention_gives_the_dense_logits_and_gradients(heads, kv_heads):
    """tree_blocks (chunks of 8 queries over their key blocks) against sdpa's dense mask, on a
    row of 4 trees: the same logits, and after a backward the same gradient of every weight."""
    trees = _forest(3, trees=4, depth=4, branches=4)
    batch = pack_trees(trees, 4096, pad_token_id=0)
    n = batch.row_length(0)
    plan = batch.tree_block_plan(0, torch.float32, block=8, dense_share=1.0)
    assert len(plan.query_offsets) - 1 == -(-n // 8) and plan.bias.numel() < n * n / 2
    inputs = {
        "sdpa": {"attention_mask": batch.attention_bias(0, torch.float32)},
        TREE_BLOCKS: {"attention_mask": None, "tree_blocks": plan},
    }
    shape = TinyModelConfig(
        hidden_size=8 * heads,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=64,
    )
    logits, grads = {}, {}
    for attention, mask in inputs.items():
        model = build_tiny_model(shape, vocab_size=VOCAB, seed=3)
        model.set_attn_implementation(attention)
        out = model(
            input_ids=batch.input_ids[:, :n], position_ids=batch.position_ids[:, :n], **mask
        ).logits
        out.square().mean().backward()
        logits[attention] = out.detach()
        grads[attention] = [p.grad for p in model.parameters()]
    torch.testing.assert_close(logits[TREE_BLOCKS], logits["sdpa"], atol=1e-5, rtol=0)
    for blocks, dense in zip(grads[TREE_BLOCKS], grads["sdpa"], strict=True):
        torch.testing.assert_close(blocks, dense, atol=1e-6, rtol=1e-4)
