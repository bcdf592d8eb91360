"""Tree-packed versus path-expanded learner step: forward + backward wall time and tokens.

Both arms compute the same paper-mode PPO loss on the same trees with the same model (fp32, CPU)
and the same micro-batch token budget (gradient accumulation): ``packed`` forwards each unique token
once (``pack_trees`` + ``packed_logprobs`` + ``routed_ppo_loss``), ``path`` forwards one row per
root-to-leaf path (``expand_paths`` + ``token_logprobs`` + ``ppo_loss``), rows grouped into
micro-batches of at most the budget in padded tokens. Timed: the forward and backward passes of one
optimizer step (packing, reference log-probs and the optimizer step itself are left out). After
one warm-up call each, the arms alternate for ``--reps`` repetitions (both see the same background
load); reported: the median times, their ratio, and the median of the per-repetition ratios.
Packed rows are forwarded without their padding; the path arm forwards its padded micro-batches.

Trees are synthetic, with the lengths of the multi-hop task at its realistic setting: 3-hop
questions (a seed chain of 3 searches and an answer), prompts of 12-20 tokens, actions of 3 tokens,
observations of 30-60 tokens (``distractors`` ~ 7-14 facts), branches planned by ``TreePlanner``
(N draws per tree per round over the root and the non-leaf nodes) and completed to the full depth;
token ids are random. Models are randomly initialised Qwen2s (``build_tiny_model``).

    python benchmarks/learner_packing.py [--out benchmarks/results/learner_packing] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from treegrpo_ray.advantage import tree_grpo_advantages
from treegrpo_ray.config import PPOConfig, TinyModelConfig
from treegrpo_ray.learners.forward import packed_logprobs, token_logprobs
from treegrpo_ray.loss import PPOCoefficients, ppo_loss, routed_ppo_loss
from treegrpo_ray.modeling import build_tiny_model
from treegrpo_ray.packing import PackedBatch, PathBatch, expand_paths, pack_trees
from treegrpo_ray.planner import TreePlanner, TreeShape
from treegrpo_ray.tree import ROOT, Tree

VOCAB = 256
HOPS = 3
MODELS = {
    "tiny": TinyModelConfig(),
    "25M": TinyModelConfig(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536
    ),
}
SHAPES = {"standard": TreeShape(m=2, n=2, l=1), "deep": TreeShape(m=2, n=2, l=2)}
COEF = PPOCoefficients.of(PPOConfig())


def synthetic_trees(shape: TreeShape, prompts: int, seed: int) -> list[Tree]:
    """Multi-hop-like trees of ``shape`` for ``prompts`` prompt groups (see the module doc)."""
    rng = random.Random(seed)
    trees = [
        Tree(g * shape.m + j, g, [rng.randrange(3, VOCAB) for _ in range(rng.randint(12, 20))])
        for g in range(prompts)
        for j in range(shape.m)
    ]
    planner = TreePlanner(shape, rng)
    expansions = planner.initial(trees)
    for _ in range(planner.rounds() + 1):
        for expansion in expansions:
            _complete_branch(trees[expansion.tree_index], expansion.node_id, rng)
        expansions = planner.next_round(trees)
    return trees


def _complete_branch(tree: Tree, parent: int, rng: random.Random) -> None:
    """Searches with 30-60 token observations, then an answer, down to depth ``HOPS``."""
    depth = 0 if parent == ROOT else tree.node(parent).depth + 1
    for level in range(depth, HOPS + 1):
        answer = level == HOPS
        node = tree.add(
            parent,
            action_ids=[rng.randrange(3, VOCAB) for _ in range(3)],
            action_logprobs=[-1.0] * 3,
            obs_ids=[] if answer else [rng.randrange(3, VOCAB) for _ in range(rng.randint(30, 60))],
            finished=answer,
            finish_reason="done" if answer else "stop",
            reward=float(rng.random() < 0.5) if answer else float("nan"),
            policy_version=0,
            role="answer" if answer else "search",
            tool_call=not answer,
        )
        parent = node.node_id


def packed_step(
    model: torch.nn.Module,
    batch: PackedBatch,
    advantages: torch.Tensor,
    mask_dtype: torch.dtype | None = None,
) -> float:
    """Forward + backward of one paper-mode step over the packed rows (a dense tree mask in
    ``mask_dtype``, default the model's); returns the loss."""
    routed = batch.route(advantages, "paper")
    denominator = float((batch.loss_mask * routed.weights).sum())
    total = 0.0
    for r in range(batch.num_rows):
        logprobs, entropy = packed_logprobs(model, batch, r, mask_dtype=mask_dtype)
        old = logprobs.detach()
        loss, _ = routed_ppo_loss(
            logprobs,
            old,
            old,
            entropy,
            routed.row(r),
            batch.loss_mask[r],
            denominator,
            COEF,
        )
        loss.backward()
        total += loss.item()
    return total


def path_micro_batches(batch: PathBatch, budget: int) -> list[torch.Tensor]:
    """Row indices of micro-batches of at most ``budget`` padded tokens (rows sorted by length)."""
    lengths = batch.attention_mask.sum(1)
    order = torch.argsort(lengths, descending=True).tolist()
    groups: list[list[int]] = [[]]
    for row in order:
        width = int(lengths[groups[-1][0]]) if groups[-1] else int(lengths[row])
        if groups[-1] and width * (len(groups[-1]) + 1) > budget:
            groups.append([])
        groups[-1].append(row)
    return [torch.tensor(g) for g in groups]


def path_step(
    model: torch.nn.Module, batch: PathBatch, advantages: torch.Tensor, budget: int
) -> tuple[float, int]:
    """Forward + backward of the path-expanded step; returns the loss and the tokens forwarded."""
    denominator = float(batch.loss_mask.sum())
    total, forwarded = 0.0, 0
    for rows in path_micro_batches(batch, budget):
        mb = batch.select(rows)
        width = int(mb.attention_mask.sum(1).max())
        ids, mask = mb.input_ids[:, :width], mb.attention_mask[:, :width]
        logprobs, entropy = token_logprobs(model, ids, mask)
        loss_mask = mb.loss_mask[:, : width - 1]
        old = logprobs.detach()
        token_advantages = advantages[rows, None].expand_as(loss_mask)
        loss, _ = ppo_loss(logprobs, old, old, entropy, token_advantages, loss_mask, COEF)
        loss = loss * loss_mask.sum() / denominator  # micro-batch token-mean -> batch token-mean
        loss.backward()
        total += loss.item()
        forwarded += ids.numel()
    return total, forwarded


def interleaved_times(arms: list, reps: int) -> list[list[float]]:
    """Wall times of ``reps`` calls of each arm, alternating arms within each repetition so that
    both see the same background load."""
    times: list[list[float]] = [[] for _ in arms]
    for _ in range(reps):
        for fn, out in zip(arms, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def run_case(model_name: str, shape_name: str, prompts: int, budget: int, reps: int) -> dict:
    trees = synthetic_trees(SHAPES[shape_name], prompts, seed=0)
    model = build_tiny_model(MODELS[model_name], VOCAB, seed=0)
    packed = pack_trees(trees, budget, pad_token_id=0)
    paths = expand_paths(trees, pad_token_id=0)
    advantages = tree_grpo_advantages(paths.rewards, paths.tree_ids, paths.group_ids)
    packed_loss = packed_step(model, packed, advantages)  # also the warm-up
    path_loss, path_forwarded = path_step(model, paths, advantages, budget)
    packed_times, path_times = interleaved_times(
        [
            lambda: packed_step(model, packed, advantages),
            lambda: path_step(model, paths, advantages, budget),
        ],
        reps,
    )
    packed_s, path_s = statistics.median(packed_times), statistics.median(path_times)
    return {
        "model": model_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "shape": shape_name,
        "trees": len(trees),
        "leaves": len(paths),
        "budget": budget,
        "unique_tokens": int(packed.token_mask.sum()) - packed.split_extra_tokens,
        "split_extra_tokens": packed.split_extra_tokens,
        "path_tokens": packed.path_tokens,
        "packed_forwarded": sum(packed.row_length(r) for r in range(packed.num_rows)),
        "path_forwarded": path_forwarded,
        "packed_rows": packed.num_rows,
        "packed_s": packed_s,
        "path_s": path_s,
        "speedup": path_s / packed_s,
        "speedup_per_rep_median": statistics.median(
            b / a for a, b in zip(packed_times, path_times, strict=True)
        ),
        "loss_abs_diff": abs(packed_loss - path_loss),
        "packed_times": packed_times,
        "path_times": path_times,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | shape | trees / leaves | unique / path tokens | forwarded packed / path "
        "| rows | packed s | path s | speedup | per-rep speedup | loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['parameters'] / 1e6:.1f}M) | {r['shape']} | "
            f"{r['trees']} / {r['leaves']} | {r['unique_tokens']} / {r['path_tokens']} "
            f"({r['path_tokens'] / r['unique_tokens']:.2f}x) | "
            f"{r['packed_forwarded']} / {r['path_forwarded']} | {r['packed_rows']} | "
            f"{r['packed_s']:.3f} | {r['path_s']:.3f} | {r['speedup']:.2f}x | "
            f"{r['speedup_per_rep_median']:.2f}x | "
            f"{r['loss_abs_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/learner_packing")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="Prompt groups per batch.")
    parser.add_argument(
        "--budget", type=int, default=1024, help="Micro-batch token budget of both arms."
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    rows = []
    for model_name in args.models:
        for shape_name in args.shapes:
            row = run_case(model_name, shape_name, args.prompts, args.budget, args.reps)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_times")}))
            rows.append(row)  # written after every case, so an interrupted run keeps its results
            (out / "results.json").write_text(
                json.dumps({"config": config, "rows": rows}, indent=2)
            )
            (out / "results.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
