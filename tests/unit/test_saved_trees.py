"""Saved trees: what the learner keeps of an update, written atomically, read back with clear
errors; and the text view of the inspector."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.advantage import tree_grpo_advantages
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.packing import pack_trees
from treegrpo_ray.saved_trees import (
    node_advantages,
    read_saved_trees,
    saved_steps,
    saved_trees_table,
    should_save,
    write_saved_trees,
)
from treegrpo_ray.tooling.inspector import render_text, step_view
from treegrpo_ray.tree import NODE_SCHEMA, ROOT, Tree, trees_from_arrow


def _decode(ids):
    return " ".join(f"w{i}" for i in ids)


def _tree(tree_id=7, group_id=2):
    # root -> 0 -> 1 (leaf, 1.0)
    #           -> 2 (leaf, 0.25)
    #      -> 3 (leaf, 0.0)
    tree = Tree(tree_id=tree_id, group_id=group_id, prompt_ids=[1, 2, 3])
    common = dict(action_logprobs=[-0.5], policy_version=3, cached_tokens=2)
    tree.add(ROOT, action_ids=[5], obs_ids=[8, 9], finished=False, finish_reason="stop",
             role="search", tool_call=True, **common)  # fmt: skip
    for parent, reward in ((0, 1.0), (0, 0.25), (ROOT, 0.0)):
        tree.add(parent, action_ids=[6], obs_ids=[], finished=True, finish_reason="done",
                 role="answer", tool_call=False, reward=reward, **common)  # fmt: skip
    return tree


def _saved(mode, leaf_advantages=(1.0, 0.5, -2.0)):
    trees = [_tree()]
    batch = pack_trees(trees, 64, pad_token_id=0)
    advantages = torch.tensor(leaf_advantages)
    nodes = batch.route_nodes(advantages, mode)
    table = saved_trees_table(
        trees, node_advantages(trees, advantages, nodes), _decode, {"step": 4, "metrics": {}}
    )
    return trees, table


def test_which_updates_keep_their_trees():
    assert [v for v in range(1, 26) if should_save(10, v, 25)] == [1, 10, 20, 25]
    assert [v for v in range(1, 4) if should_save(1, v, 3)] == [1, 2, 3]
    assert not any(should_save(0, v, 25) for v in range(1, 26))


def test_paper_mode_keeps_leaf_advantages_and_the_routed_parts():
    trees, table = _saved("paper")
    # node 0 has leaves 1 (A = 1.0) and 2 (A = 0.5) below: positive 1.5, negative 0
    assert table.column("advantage").to_pylist() == [None, 1.0, 0.5, -2.0]
    assert table.column("routed_positive").to_pylist() == [1.5, 1.0, 0.5, 0.0]
    assert table.column("routed_negative").to_pylist() == [0.0, 0.0, 0.0, -2.0]
    assert table.column("routed_advantage").to_pylist() == [1.5, 1.0, 0.5, -2.0]
    assert table.column("action_text").to_pylist() == ["w5", "w6", "w6", "w6"]
    assert table.column("obs_text").to_pylist() == ["w8 w9", "", "", ""]
    assert table.column("prompt_text").to_pylist() == ["w1 w2 w3", None, None, None]
    assert table.column("cached_tokens").to_pylist() == [2, 2, 2, 2]
    # the wire columns come first and still read back as the same trees
    assert table.schema.names[: len(NODE_SCHEMA)] == NODE_SCHEMA.names
    back = trees_from_arrow(table.select(NODE_SCHEMA.names))
    assert [n.reward for n in back[0].nodes][1:] == [1.0, 0.25, 0.0]


def test_mean_mode_keeps_the_mean_and_no_parts():
    _, table = _saved("mean")
    assert table.column("routed_advantage").to_pylist() == [0.75, 1.0, 0.5, -2.0]
    assert table.column("routed_positive").null_count == 4
    assert table.column("routed_negative").null_count == 4


def test_written_atomically_and_read_back(tmp_path):
    _, table = _saved("paper")
    path = write_saved_trees(tmp_path, 4, table)
    assert path == tmp_path / "trees" / "step-000004.parquet"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    back, meta = read_saved_trees(tmp_path, 4)
    assert back.schema == table.schema and meta == {"step": 4, "metrics": {}}
    assert repr(back.to_pylist()) == repr(table.to_pylist())  # NaN rewards compare as text
    write_saved_trees(tmp_path, 10, table)
    assert saved_steps(tmp_path) == [4, 10]


def test_reading_a_missing_run_an_unsaved_step_and_a_corrupt_file(tmp_path):
    with pytest.raises(UserInputError, match="no run directory"):
        saved_steps(tmp_path / "nowhere")
    with pytest.raises(UserInputError, match="holds no saved trees"):
        saved_steps(tmp_path)
    write_saved_trees(tmp_path, 4, _saved("paper")[1])
    with pytest.raises(UserInputError, match="step 5 of .* was not saved; saved steps: 4"):
        read_saved_trees(tmp_path, 5)
    (tmp_path / "trees" / "step-000006.parquet").write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(UserInputError, match="step-000006.parquet is not a readable"):
        read_saved_trees(tmp_path, 6)


def test_text_view_indents_children_under_their_parent():
    _, table = _saved("paper")
    text = render_text(step_view(table, {"step": 4, "metrics": {"budget/tool_calls": 1.0}}))
    assert text.splitlines() == [
        "step 4: 1/1 prompts with reward variance, 1 tool calls, 4 nodes, 3 leaves",
        "prompt 0 (group 2): w1 w2 w3",
        "  tree 7",
        "    [0] search: w5  -> w8 w9  sumA=+1.500  (+1.500/0.000)  v3 cache 2/3",
        "      [1] answer: w6  R=1 A=+1.000  (+1.000/0.000)  v3 cache 2/6",
        "      [2] answer: w6  R=0.25 A=+0.500  (+0.500/0.000)  v3 cache 2/6",
        "    [3] answer: w6  R=0 A=-2.000  (+0.000/-2.000)  v3 cache 2/3",
    ]


def test_adaptive_expansion_columns_are_shown_when_the_trees_carry_them():
    _, table = _saved("paper")
    view = step_view(table, {"step": 4})
    assert {node["entropy"] for node in view["groups"][0]["trees"][0]["nodes"]} == {None}
    table = table.append_column("entropy", pa.array([0.5, 0.25, 1.5, 2.0], pa.float32()))
    table = table.append_column("select_reason", pa.array([None, "entropy", "entropy", None]))
    nodes = step_view(table, {"step": 4})["groups"][0]["trees"][0]["nodes"]
    assert [(n["entropy"], n["select_reason"]) for n in nodes] == [
        (0.5, None), (0.25, "entropy"), (1.5, "entropy"), (2.0, None)
    ]  # fmt: skip
    assert (
        render_text(step_view(table, {"step": 4}))
        .splitlines()[4]
        .endswith("v3 cache 2/6  entropy=0.250  select_reason=entropy")
    )


def test_the_learner_saves_what_its_update_gave_each_node(tiny_cfg, untrained_policy, tmp_path):
    """Real trees, a real update: the saved leaf advantages are Tree-GRPO's of the leaf rewards,
    each node's routed advantage is the sum over the leaves below it (paper mode), the text is
    the tokenizer's decoding of the saved tokens."""
    worker = RolloutWorker(
        untrained_policy, tiny_cfg.task, tiny_cfg.tree, tiny_cfg.sampling, seed=0
    )
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()[:4]
    trees = trees_from_arrow(worker.expand(Lease(0, tuple(enumerate(samples)), seed=5)))
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    metrics = learner.update(trees)
    path = learner.save_trees(tmp_path, trees, metrics)

    table = pq.read_table(path)
    _, meta = read_saved_trees(tmp_path, 1)
    assert meta["step"] == 1 and meta["metrics"]["tree/nodes"] == table.num_rows
    rows = table.to_pylist()
    leaves = [r for r in rows if r["finished"]]
    expected = tree_grpo_advantages(
        torch.tensor([r["reward"] for r in leaves]),
        torch.tensor([r["tree_id"] for r in leaves]),
        torch.tensor([r["group_id"] for r in leaves]),
    )
    assert [r["advantage"] for r in leaves] == pytest.approx(expected.tolist(), abs=1e-6)
    by_node = {(r["tree_id"], r["node_id"]): r for r in rows}
    for tree in trees:
        for node in tree.nodes:
            row = by_node[(tree.tree_id, node.node_id)]
            below = [by_node[(tree.tree_id, leaf.node_id)]["advantage"] for leaf in tree.leaves()
                     if node in tree.path(leaf.node_id)]  # fmt: skip
            assert row["routed_advantage"] == pytest.approx(sum(below), abs=1e-5)
            assert row["routed_positive"] == pytest.approx(sum(a for a in below if a > 0), abs=1e-5)
            assert row["action_text"] == learner.tokenizer.decode(node.action_ids)
            assert row["cached_tokens"] == node.cached_tokens
            assert (row["advantage"] is None) == (not node.finished)
            assert math.isnan(row["reward"]) != node.finished
