"""The tree inspector behind ``treegrpo trees RUN``: a run's saved trees (``saved_trees``) as one
self-contained HTML page (every script and style inline, no network) or an indented text view.

Both read a step as a ``step_view``: the step's header figures and, per prompt group, its trees'
nodes with the text, reward, advantages, policy version, cache use and, when the trees carry them,
the adaptive-expansion columns (``OPTIONAL_COLUMNS``; blank otherwise).
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa

from treegrpo_ray.errors import UserInputError
from treegrpo_ray.saved_trees import not_saved, read_saved_trees, saved_steps

OPTIONAL_COLUMNS = ("entropy", "select_score", "select_reason")
TEXT_WIDTH = 72  # characters of an action or observation on one line of the text view


def _finite(value: Any) -> Any:
    """None for NaN / infinite floats (JSON has no NaN), the value otherwise."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _node_view(row: dict[str, Any], prefix_tokens: int) -> dict[str, Any]:
    """One node as the page and the text view show it."""
    logprobs = row["action_logprobs"] or []
    view = {
        "id": row["node_id"],
        "parent": row["parent_id"],
        "depth": row["depth"],
        "role": row["role"],
        "finish": row["finish_reason"],
        "leaf": row["finished"],
        "tool_call": row["tool_call"],
        "action": row["action_text"],
        "obs": row["obs_text"],
        "action_tokens": len(row["action_ids"]),
        "obs_tokens": len(row["obs_ids"]),
        "logprob_mean": sum(logprobs) / len(logprobs) if logprobs else None,
        "reward": row["reward"],
        "advantage": row["advantage"],
        "routed": row["routed_advantage"],
        "positive": row["routed_positive"],
        "negative": row["routed_negative"],
        "version": row["policy_version"],
        "cached": row["cached_tokens"],
        "prefix": prefix_tokens,
    }
    view.update({name: row.get(name) for name in OPTIONAL_COLUMNS})
    return {key: _finite(value) for key, value in view.items()}


def _group_views(table: pa.Table) -> list[dict[str, Any]]:
    """Per prompt group (ascending group id): its prompt and its trees' node views."""
    groups: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(dict)
    prompts: dict[int, str] = {}
    prefix: dict[tuple[int, int], int] = {}  # (tree, node) -> tokens up to and including it
    for row in table.to_pylist():
        tree, node = row["tree_id"], row["node_id"]
        if row["prompt_ids"] is not None:
            prompts[row["group_id"]] = row["prompt_text"]
            prefix[(tree, -1)] = len(row["prompt_ids"])
        above = prefix[(tree, row["parent_id"])]
        prefix[(tree, node)] = above + len(row["action_ids"]) + len(row["obs_ids"])
        groups[row["group_id"]].setdefault(tree, []).append(_node_view(row, above))
    return [
        {
            "index": index,
            "group": group,
            "prompt": prompts[group],
            "trees": [{"tree": tree, "nodes": nodes} for tree, nodes in groups[group].items()],
        }
        for index, group in enumerate(sorted(groups))
    ]


def _varied(group: dict[str, Any]) -> bool:
    """Whether the group's leaves disagree in reward (only then does it carry a gradient)."""
    rewards = {n["reward"] for t in group["trees"] for n in t["nodes"] if n["leaf"]}
    return len(rewards) > 1


def step_view(table: pa.Table, meta: dict[str, Any], prompt: int | None = None) -> dict[str, Any]:
    """One saved step as plain data (JSON-ready): ``header`` figures of the whole step and the
    prompt groups (only group ``prompt``, by position in the step, when given)."""
    groups = _group_views(table)
    metrics = meta.get("metrics", {})
    header = {
        "prompts": len(groups),
        "varied": sum(_varied(g) for g in groups),
        "nodes": table.num_rows,
        "leaves": sum(table.column("finished").to_pylist()),
        "reward_mean": metrics.get("tree/reward_mean"),
        "cache_hit_rate": metrics.get("rollout/cache_hit_rate"),
        "generated_tokens": metrics.get("budget/generated_tokens"),
        "prefill_tokens": metrics.get("budget/prefill_tokens"),
        "tool_calls": metrics.get("budget/tool_calls"),
    }
    if prompt is not None:
        if not 0 <= prompt < len(groups):
            raise UserInputError(
                f"--prompt {prompt} is out of range: step {meta['step']} has {len(groups)} "
                f"prompts (0-{len(groups) - 1})"
            )
        groups = groups[prompt : prompt + 1]
    return {
        "step": meta["step"],
        "advantage": meta.get("advantage"),
        "loss_mode": meta.get("loss_mode"),
        "header": {key: _finite(value) for key, value in header.items()},
        "groups": groups,
    }


def load_steps(
    run_dir: Path, step: int | None, prompt: int | None, every_step: bool
) -> list[dict[str, Any]]:
    """Step views of ``run_dir``: every saved step (``every_step``) or only ``step`` (None: the
    last saved). UserInputError for a missing run, an unsaved step, an unreadable file."""
    steps = saved_steps(run_dir)
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise not_saved(run_dir, chosen, steps)
    wanted = steps if every_step else [chosen]
    return [step_view(*read_saved_trees(run_dir, s), prompt) for s in wanted]


def _json_for_script(data: Any) -> str:
    """JSON that is safe inside a ``<script>`` element (no ``</script>`` or ``<!--``)."""
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def render_html(views: list[dict[str, Any]], selected: int, title: str) -> str:
    """The inspector page: ``views`` (one per saved step) embedded as inert JSON, each parsed
    only when shown; ``selected`` is the step shown first."""
    template = resources.files("treegrpo_ray.tooling").joinpath("inspector.html").read_text()
    data = "\n".join(
        f'<script type="application/json" class="step-data" data-step="{v["step"]}">'
        f"{_json_for_script(v)}</script>"
        for v in views
    )
    values = {"TITLE": html.escape(title), "SELECTED": str(selected), "STEP_DATA": data}
    return re.sub(r"__(TITLE|SELECTED|STEP_DATA)__", lambda m: values[m[1]], template)


def _line(text: str | None) -> str:
    """``text`` on one line, at most ``TEXT_WIDTH`` characters (``…`` when cut)."""
    flat = " ".join((text or "").split())
    return flat if len(flat) <= TEXT_WIDTH else flat[: TEXT_WIDTH - 1] + "…"


def _number(value: float | None, fmt: str = "+.3f") -> str:
    return "" if value is None else format(value, fmt)


def _node_line(node: dict[str, Any]) -> str:
    """A node on one line: role, action, observation, reward and advantages, version, cache."""
    parts = [f"[{node['id']}] {node['role']}: {_line(node['action'])}"]
    if node["obs"]:
        parts.append(f"-> {_line(node['obs'])}")
    if node["leaf"]:
        parts.append(f"R={_number(node['reward'], 'g')} A={_number(node['advantage'])}")
    else:
        parts.append(f"sumA={_number(node['routed'])}")
    if node["positive"] is not None:
        parts.append(f"(+{_number(node['positive'], '.3f')}/{_number(node['negative'], '.3f')})")
    parts.append(f"v{node['version']} cache {node['cached']}/{node['prefix']}")
    extra = [
        f"{name}={_number(node[name], '.3f') if isinstance(node[name], float) else node[name]}"
        for name in OPTIONAL_COLUMNS
        if node[name] is not None
    ]
    return "  ".join(parts + extra)


def render_text(view: dict[str, Any]) -> str:
    """The step as an indented terminal view: a header line, then per prompt group its trees,
    each node indented under its parent."""
    h = view["header"]
    figures = [
        (h["varied"], f"{h['varied']}/{h['prompts']} prompts with reward variance"),
        (h["cache_hit_rate"], f"cache hit rate {_number(h['cache_hit_rate'], '.1%')}"),
        (h["generated_tokens"], f"{_number(h['generated_tokens'], '.0f')} generated tokens"),
        (h["tool_calls"], f"{_number(h['tool_calls'], '.0f')} tool calls"),
        (h["nodes"], f"{h['nodes']} nodes, {h['leaves']} leaves"),
    ]
    known = ", ".join(text for value, text in figures if value is not None)
    lines = [f"step {view['step']}: {known}"]
    for group in view["groups"]:
        lines.append(f"prompt {group['index']} (group {group['group']}): {_line(group['prompt'])}")
        for tree in group["trees"]:
            lines.append(f"  tree {tree['tree']}")
            lines += [f"    {'  ' * n['depth']}{_node_line(n)}" for n in _depth_first(tree)]
    return "\n".join(lines)


def _depth_first(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """The tree's nodes with every node directly above its subtree (children in id order)."""
    children: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for node in tree["nodes"]:
        children[node["parent"]].append(node)
    order, stack = [], children[-1][::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack += children[node["id"]][::-1]
    return order
