"""Block-sparse tree attention (``ppo.attention=blocks``) against the dense mask, row by row.

On the packed rows of a run's saved trees (the learner's layout: ``pack_trees`` at the preset's
``micro_batch_tokens``), with random queries, keys and values of SmolLM2-135M's attention shape
(9 query heads, 3 key/value heads, 64 dims), each arm's forward and backward through one
attention layer: ``dense``, SDPA with the row's additive tree mask (what ``ppo.attention=sdpa``
runs), and ``blocks B``, ``tree_attention.block_attention`` over the row's plan with B-token
chunks, always chunked (``dense_share=1``), so that the table shows where chunking pays and where
the dense mask is faster (``packing.DENSE_SHARE`` is read off it). The arms alternate within each
repetition; reported per row: the share of the n² pairs the plan keeps, median times, their
ratio to dense, and the largest output difference.

    python -m benchmarks.tree_block_attention [--run benchmarks/results/smollm2-search-qa-v4] \
        [--steps 1 10 20 30] [--out benchmarks/results/tree_block_attention]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.learner_packing import interleaved_times
from treegrpo_ray.packing import PackedBatch, pack_trees
from treegrpo_ray.saved_trees import read_saved_trees, saved_trees_as_trees
from treegrpo_ray.tree_attention import block_attention


def _dense(query, key, value, bias):
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, enable_gqa=True
    ).transpose(1, 2)


def _blocks(query, key, value, plan):
    return block_attention(
        query,
        key,
        value,
        plan.query_offsets,
        plan.key_offsets,
        plan.key_index,
        plan.bias,
        query.shape[-1] ** -0.5,
    )[0]


def _forward_backward(attend, inputs, grad):
    for tensor in inputs:
        tensor.grad = None
    out = attend()
    out.backward(grad)
    return out.detach()


def run_row(batch: PackedBatch, row: int, blocks: list[int], shape: tuple, reps: int) -> dict:
    heads, kv_heads, dim = shape
    n = batch.row_length(row)
    query = torch.randn(1, heads, n, dim, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, n, dim, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, n, heads, dim)
    bias = batch.attention_bias(row, torch.float32)
    arms = {"dense": lambda: _dense(query, key, value, bias)}
    plans = {b: batch.tree_block_plan(row, torch.float32, b, dense_share=1.0) for b in blocks}
    for b, plan in plans.items():
        arms[f"blocks {b}"] = lambda plan=plan: _blocks(query, key, value, plan)
    inputs = (query, key, value)
    outputs = {name: _forward_backward(attend, inputs, grad) for name, attend in arms.items()}
    times = interleaved_times(
        [lambda a=attend: _forward_backward(a, inputs, grad) for attend in arms.values()], reps
    )
    medians = dict(zip(arms, map(statistics.median, times), strict=True))
    return {
        "row": row,
        "tokens": n,
        "pairs_kept": {b: plan.bias.numel() / n**2 for b, plan in plans.items()},
        "seconds": medians,
        "vs_dense": {name: s / medians["dense"] for name, s in medians.items()},
        "max_abs_diff": max(
            float((out - outputs["dense"]).abs().max()) for out in outputs.values()
        ),
    }


def markdown(rows: list[dict], blocks: list[int]) -> str:
    head = " | ".join(f"blocks {b}: pairs kept, ms, vs dense" for b in blocks)
    lines = [
        f"| step | row | tokens | dense ms | {head} | max diff |",
        "|---" * (5 + len(blocks)) + "|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{r['pairs_kept'][b]:.2f}, {r['seconds'][f'blocks {b}'] * 1e3:.1f}, "
            f"{r['vs_dense'][f'blocks {b}']:.2f}x"
            for b in blocks
        )
        lines.append(
            f"| {r['step']} | {r['row']} | {r['tokens']} | {r['seconds']['dense'] * 1e3:.1f} | "
            f"{cells} | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="benchmarks/results/smollm2-search-qa-v4")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10, 20, 30])
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--shape", type=int, nargs=3, default=[9, 3, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/tree_block_attention")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in args.steps:
        table, _ = read_saved_trees(Path(args.run), step)
        batch = pack_trees(saved_trees_as_trees(table), args.micro_batch_tokens, pad_token_id=0)
        for row in range(batch.num_rows):
            result = {"step": step, **run_row(batch, row, args.blocks, args.shape, args.reps)}
            print(json.dumps(result), flush=True)
            rows.append(result)  # written after every row: an interrupted run keeps its results
            (out / "results.json").write_text(
                json.dumps({"config": vars(args), "rows": rows}, indent=2)
            )
            (out / "results.md").write_text(markdown(rows, args.blocks))
    print(markdown(rows, args.blocks))


if __name__ == "__main__":
    main()
