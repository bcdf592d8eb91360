import math
import random
from dataclasses import astuple

import pytest

from treegrpo_ray.budget import Budget
from treegrpo_ray.planner import TreePlanner, TreeShape
from treegrpo_ray.tree import (
    NODE_SCHEMA,
    ROOT,
    BatchInfo,
    Tree,
    batch_info,
    trees_from_arrow,
    trees_to_arrow,
)


def _node(finished=False, reward=math.nan, **kw):
    fields = dict(
        action_ids=[5, 6, 7],
        action_logprobs=[-0.5, -0.25, -1.0],
        obs_ids=[8, 9],
        finished=finished,
        finish_reason="done" if finished else "stop",
        policy_version=3,
        role="answer" if finished else "search",
        tool_call=not finished,
        reward=reward,
        cached_tokens=4,
        entropy=0.75,
    )
    fields.update(kw)
    return fields


def _example_tree(tree_id=7, group_id=2):
    # root -> 0 -> 1 (leaf, 1.0)
    #           -> 2 (leaf, 0.25)
    #      -> 3 (leaf, truncated, 0.0)
    tree = Tree(tree_id=tree_id, group_id=group_id, prompt_ids=[1, 2, 3])
    tree.add(ROOT, **_node())
    tree.add(0, **_node(finished=True, reward=1.0, obs_ids=[]))
    tree.add(
        0, **_node(finished=True, reward=0.25, obs_ids=[], select_score=0.5, select_reason="x")
    )
    tree.add(
        ROOT, **_node(finished=True, reward=0.0, obs_ids=[], finish_reason="length", entropy=None)
    )
    return tree


def _comparable(tree):
    return [
        tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in astuple(n)[:-1])
        for n in tree.nodes
    ]


def test_arrow_round_trip_keeps_every_field():
    trees = [_example_tree(7, 2), _example_tree(8, 2)]
    info = BatchInfo(
        4, policy_version=3, budgets={2: Budget(generated_tokens=9)}, rollout_seconds=1.5
    )
    table = trees_to_arrow(trees, info)
    assert table.schema.names == NODE_SCHEMA.names
    assert table.num_rows == 8
    # the prompt is stored once per tree; the optional columns are null where unknown
    assert table.column("prompt_ids").null_count == 6
    assert table.column("entropy").to_pylist()[:4] == [0.75, 0.75, 0.75, None]
    assert table.column("select_score").to_pylist()[:4] == [None, None, 0.5, None]
    assert table.column("select_reason").to_pylist()[:4] == [None, None, "x", None]
    back = trees_from_arrow(table)
    assert [(t.tree_id, t.group_id, t.prompt_ids) for t in back] == [
        (7, 2, [1, 2, 3]),
        (8, 2, [1, 2, 3]),
    ]
    assert _comparable(back[0]) == _comparable(trees[0])
    assert batch_info(table) == info


def test_tree_paths_prefixes_and_depths():
    tree = _example_tree()
    assert [n.node_id for n in tree.path(2)] == [0, 2]
    assert tree.node(2).depth == 1
    assert tree.prefix_ids(0) == [1, 2, 3, 5, 6, 7, 8, 9]
    assert tree.prefix_ids(ROOT) == [1, 2, 3]
    assert tree.expandable() == [ROOT, 0]
    assert [n.node_id for n in tree.leaves()] == [1, 2, 3]


def test_token_counts_of_the_tree_and_of_a_path():
    tree = _example_tree()  # prompt 3 tokens; node 0: 3 action + 2 observation; leaves: 3 each
    assert tree.token_count == 3 + 5 + 3 + 3 + 3
    assert tree.path_token_count(2) == 3 + 5 + 3
    assert tree.path_token_count(3) == 3 + 3
    assert tree.path_token_count(ROOT) == 3


def test_keep_leaves_prunes_and_renumbers():
    tree = _example_tree()
    tree.keep_leaves({2, 3})
    assert [(n.node_id, n.parent_id, n.reward) for n in tree.nodes][1:] == [
        (1, 0, 0.25),
        (2, ROOT, 0.0),
    ]


def test_planner_draws_only_from_root_and_non_leaf_nodes():
    planner = TreePlanner(TreeShape(m=1, n=50, l=1), random.Random(0))
    expansions = planner.next_round([_example_tree(), _example_tree()])
    assert len(expansions) == 100
    assert {e.node_id for e in expansions} == {ROOT, 0}
    assert {e.tree_index for e in expansions} == {0, 1}


@pytest.mark.parametrize("shape", [TreeShape(4, 0, 3), TreeShape(4, 2, 0)])
def test_chain_shapes_have_no_expansion_rounds(shape):
    planner = TreePlanner(shape, random.Random(0))
    assert planner.rounds() == 0
    assert shape.leaves_per_prompt == 4


def test_leaf_counts_of_paper_shapes():
    assert TreeShape(1, 2, 1).leaves_per_prompt == 3
    assert TreeShape(2, 2, 1).leaves_per_prompt == 6
    assert TreeShape(4, 5, 1).leaves_per_prompt == 24
