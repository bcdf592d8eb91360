"""Trees kept with a run (DESIGN §9): ``RUN/trees/step-NNNNNN.parquet``, one file per saved update.

Every ``train.save_trees_every`` updates, and at the first and the last, the learner (rank 0)
writes the trees of that update, one row per node: the Arrow columns of the wire format
(``tree.trees_to_arrow``, whatever optional columns it carries, e.g. ``entropy``,
``select_score``, ``select_reason``) plus

- ``prompt_text`` (on each tree's first row, null on the others), ``action_text``, ``obs_text``:
  the decoded tokens, for display only;
- ``advantage``: the leaf's advantage (null on inner nodes), as the update computed it;
- ``routed_advantage``: the advantage mass routed to the node, as the loss used it (per-node
  modifiers applied): in ``paper`` mode the sum of the leaf advantages below,
  ``routed_positive + routed_negative``; in ``mean`` mode their mean (the parts are null).

The schema metadata (``treegrpo_saved``) holds the step, the advantage and loss modes, and the
update's metrics (``tree/``, ``rollout/``, ``budget/``, ``learner/``...). A file is written to a
temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from treegrpo_ray.advantage import RoutedAdvantages
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.tree import NODE_SCHEMA, Tree, trees_from_arrow, trees_to_arrow

TREES_DIR = "trees"
META_KEY = b"treegrpo_saved"
STEP_FILE = re.compile(r"step-(\d{6})\.parquet")

SAVED_COLUMNS = pa.schema(
    [
        ("prompt_text", pa.string()),
        ("action_text", pa.string()),
        ("obs_text", pa.string()),
        ("advantage", pa.float32()),
        ("routed_advantage", pa.float32()),
        ("routed_positive", pa.float32()),
        ("routed_negative", pa.float32()),
    ]
)


@dataclass(frozen=True)
class NodeAdvantage:
    """leaf: the node's own advantage if it is a leaf, else None. routed: the parts the loss
    routed to it, ``(positive, negative)`` in ``paper`` mode, ``(mean,)`` in ``mean`` mode."""

    leaf: float | None
    routed: tuple[float, ...]


def node_advantages(
    trees: list[Tree], leaf_advantages: torch.Tensor, nodes: RoutedAdvantages
) -> dict[tuple[int, int], NodeAdvantage]:
    """Per ``(tree_id, node_id)`` of the trees of one packed batch: its leaf advantage and routed
    parts. leaf_advantages: (L,) in ``pack_trees``' leaf order (trees in order, each tree's
    leaves in node order); nodes: the batch's node routing, advantages (K, N) in node order."""
    leaf_values = iter(leaf_advantages.tolist())
    leaf_of = {(t.tree_id, leaf.node_id): next(leaf_values) for t in trees for leaf in t.leaves()}
    parts = nodes.advantages.T.tolist()  # (N, K)
    keys = [(t.tree_id, node.node_id) for t in trees for node in t.nodes]
    return {
        key: NodeAdvantage(leaf_of.get(key), tuple(routed))
        for key, routed in zip(keys, parts, strict=True)
    }


def should_save(every: int, version: int, steps: int) -> bool:
    """Whether the update that made policy ``version`` keeps its trees: every ``every``-th, the
    first and the last of ``steps``; never when ``every`` is 0."""
    return every > 0 and (version == 1 or version % every == 0 or version == steps)


def saved_trees_table(
    trees: list[Tree],
    advantages: dict[tuple[int, int], NodeAdvantage],
    decode: Callable[[list[int]], str],
    meta: dict[str, Any],
) -> pa.Table:
    """The saved form of one update's trees (see the module docstring); ``meta`` goes to the
    schema metadata (JSON)."""
    columns: dict[str, list[Any]] = {name: [] for name in SAVED_COLUMNS.names}
    for tree in trees:
        for node in tree.nodes:
            adv = advantages[(tree.tree_id, node.node_id)]
            columns["prompt_text"].append(decode(tree.prompt_ids) if node.node_id == 0 else None)
            columns["action_text"].append(decode(node.action_ids))
            columns["obs_text"].append(decode(node.obs_ids))
            columns["advantage"].append(adv.leaf)
            columns["routed_advantage"].append(sum(adv.routed))
            paper = len(adv.routed) == 2
            columns["routed_positive"].append(adv.routed[0] if paper else None)
            columns["routed_negative"].append(adv.routed[1] if paper else None)
    table = trees_to_arrow(trees, None)
    for field in SAVED_COLUMNS:
        table = table.append_column(field, pa.array(columns[field.name], field.type))
    return table.replace_schema_metadata({META_KEY: json.dumps(meta)})


def step_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / TREES_DIR / f"step-{step:06d}.parquet"


def write_saved_trees(run_dir: Path, step: int, table: pa.Table) -> Path:
    """Write ``table`` as ``RUN/trees/step-NNNNNN.parquet`` atomically (temp name, rename);
    returns the path."""
    path = step_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, temp, compression="zstd")
    os.replace(temp, path)
    return path


def saved_steps(run_dir: Path) -> list[int]:
    """The steps saved in ``run_dir``, ascending. UserInputError when ``run_dir`` is not a
    directory or holds no saved trees."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserInputError(f"no run directory {run_dir}; give the path of a run, e.g. runs/NAME")
    folder = run_dir / TREES_DIR
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    steps = sorted(int(m[1]) for m in map(STEP_FILE.fullmatch, names) if m)
    if not steps:
        raise UserInputError(
            f"{run_dir} holds no saved trees ({folder}/step-NNNNNN.parquet); runs save them every "
            "train.save_trees_every updates (0 turns it off)"
        )
    return steps


def not_saved(run_dir: Path, step: int, steps: list[int]) -> UserInputError:
    """The error for a step that ``run_dir`` did not save (``steps``: the ones it did)."""
    return UserInputError(
        f"step {step} of {run_dir} was not saved; saved steps: {', '.join(map(str, steps))}"
    )


def read_saved_trees(run_dir: Path, step: int) -> tuple[pa.Table, dict[str, Any]]:
    """The saved table of ``step`` and its metadata. UserInputError when the step was not saved
    or its file cannot be read."""
    steps = saved_steps(run_dir)
    if step not in steps:
        raise not_saved(run_dir, step, steps)
    path = step_path(run_dir, step)
    try:
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {}).get(META_KEY, b"null"))
    except (OSError, pa.ArrowException, ValueError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise UserInputError(
            f"{path} is not a readable saved-trees file ({reason}); delete it or train again"
        ) from None
    lacks = [f"column {name}" for name in SAVED_COLUMNS.names if name not in table.schema.names]
    lacks += [f"{META_KEY.decode()} metadata"] if meta is None else []
    if lacks:
        raise UserInputError(
            f"{path} is not a saved-trees file (it lacks {', '.join(lacks)}); delete it or "
            "train again"
        )
    return table, meta


def saved_trees_as_trees(table: pa.Table) -> list[Tree]:
    """The trees of a saved table (its wire columns; the decoded text and advantages dropped)."""
    return trees_from_arrow(table.select([n for n in table.column_names if n in NODE_SCHEMA.names]))
