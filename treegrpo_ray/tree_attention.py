"""Tree attention that skips what the tree hides, as transformers attention implementations:
``tree_flex`` (PyTorch's flex_attention, CUDA) and ``tree_blocks`` (block-sparse, CPU).

transformers' own ``flex_attention`` implementation always goes through ``torch.compile``, with
``dynamic=False``: every packed row length is a new compilation (and past dynamo's recompile
limit, the unfused fallback), and on CPU torch 2.13's Inductor template for a block mask that
reads tensors fails to compile (a C++ error). ``tree_flex`` calls ``flex_attention`` compiled
with dynamo's default (the second length compiles a dynamic-shape kernel, reused for all others)
on CUDA and unfused on the CPU, where it serves to check the block mask against the dense one.
The mask it takes is ``PackedBatch.flex_block_mask``.

``tree_blocks`` is the CPU's: flex_attention has no backward there (torch 2.13), and a dense
mask makes PyTorch's CPU flash kernel compute all n² pairs of a packed row, most of which the
tree hides (a token sees its ancestors, not its cousins: on the SmolLM2 preset's rows 0.3-0.75
of the causal half). It runs the same flash kernel chunk by chunk, each chunk of queries over only
the key blocks it sees (``PackedBatch.tree_block_plan``), forward and backward, as one opaque
custom op: compiled decoder layers keep one graph. The plan comes as the keyword argument
``tree_blocks`` of the model's forward (transformers hands unknown keyword arguments down to
the attention function); the model's own ``attention_mask`` stays None.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface

from treegrpo_ray.packing import TreeBlockPlan

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

TREE_FLEX = "tree_flex"
TREE_BLOCKS = "tree_blocks"
# Queries per chunk, and the key block size, of tree_blocks: of 32, 64 and 128, 64 ran the
# SmolLM2 preset's rows fastest or within 6% of the fastest, forward and backward
# (benchmarks/tree_block_attention.py).
TREE_BLOCK = 64


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def tree_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of query (B, H, n, D) over key, value (B, H_kv, n, D) under the block mask;
    returns (B, n, H, D), as transformers' attention functions do, and no weights."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask):
        raise TypeError(
            f"{TREE_FLEX} attention takes the packed row's BlockMask "
            f"(PackedBatch.flex_block_mask), got {type(attention_mask).__name__}"
        )
    groups = query.shape[1] // key.shape[1]
    if groups & (groups - 1):
        # flex's decoding kernel (short rows) needs a power-of-two number of query heads per key
        # head (Qwen2.5-0.5B has 7): give every query head its own copy, as transformers does
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    attend = _compiled_flex_attention() if query.is_cuda else flex_attention
    out = attend(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_FLEX, tree_flex_attention)


def tree_block_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    scaling: float | None = None,
    tree_blocks: TreeBlockPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of query (1, H, n, D) over key, value (1, H_kv, n, D) under the tree mask of
    ``tree_blocks``; returns (1, n, H, D), as transformers' attention functions do."""
    if not isinstance(tree_blocks, TreeBlockPlan) or attention_mask is not None:
        raise TypeError(
            f"{TREE_BLOCKS} attention takes the packed row's plan as the forward's keyword "
            "tree_blocks (PackedBatch.tree_block_plan) and no attention_mask"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    plan = (tree_blocks.query_offsets, tree_blocks.key_offsets, tree_blocks.key_index)
    out, _ = block_attention(query, key, value, *plan, tree_blocks.bias, scale)
    return out, None


AttentionInterface.register(TREE_BLOCKS, tree_block_attention)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _chunks(
    query_offsets: torch.Tensor, key_offsets: torch.Tensor
) -> list[tuple[slice, slice, slice]]:
    """Per chunk of a ``TreeBlockPlan``: its slices of the queries, of the gathered keys and
    of the bias."""
    queries, keys = query_offsets.tolist(), key_offsets.tolist()
    out: list[tuple[slice, slice, slice]] = []
    bias_start = 0
    for c in range(len(queries) - 1):
        size = (queries[c + 1] - queries[c]) * (keys[c + 1] - keys[c])
        out.append(
            (
                slice(queries[c], queries[c + 1]),
                slice(keys[c], keys[c + 1]),
                slice(bias_start, bias_start + size),
            )
        )
        bias_start += size
    return out


def _gathered(tensor: torch.Tensor, key_index: torch.Tensor, chunks: int) -> torch.Tensor:
    """(1, H_kv, n, D) -> (1, H_kv, K, D): the plan's keys, in its order (the flash kernel
    reads grouped heads itself). A plan of one chunk over all n keys (the dense mask) reads the
    tensor as it is."""
    if chunks == 1 and key_index.numel() == tensor.shape[2]:
        return tensor
    return tensor.index_select(2, key_index)


def _empty_outputs(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_attention``'s outputs for query (1, H, n, D), unfilled: out (1, n, H, D) and the
    log-sum-exp (1, H, n) float32."""
    heads, n, dim = query.shape[1:]
    return query.new_empty((1, n, heads, dim)), query.new_empty((1, heads, n), dtype=torch.float32)


def _chunk_mask(bias: torch.Tensor, entries: slice, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return bias[entries].view(1, 1, rows, -1).to(dtype)


@torch.library.custom_op("treegrpo::block_attention", mutates_args=())
def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_offsets: torch.Tensor,
    key_offsets: torch.Tensor,
    key_index: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention of query (1, H, n, D) over key, value (1, H_kv, n, D), chunk by chunk
    over the plan's keys: out (1, n, H, D) and each query's log-sum-exp (1, H, n) float32, which
    the backward reads."""
    out, lse = _empty_outputs(query)
    chunks = _chunks(query_offsets, key_offsets)
    keys, values = (_gathered(t, key_index, len(chunks)) for t in (key, value))
    for rows, cols, entries in chunks:
        mask = _chunk_mask(bias, entries, rows.stop - rows.start, query.dtype)
        out_c, lse_c = _flash(
            query[:, :, rows], keys[:, :, cols], values[:, :, cols], attn_mask=mask, scale=scale
        )
        out[:, rows] = out_c.transpose(1, 2)
        lse[:, :, rows] = lse_c
    return out, lse


@torch.library.custom_op("treegrpo::block_attention_backward", mutates_args=())
def block_attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    query_offsets: torch.Tensor,
    key_offsets: torch.Tensor,
    key_index: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query (1, H, n, D) and key, value (1, H_kv, n, D) from the output's (1, n,
    H, D)."""
    chunks = _chunks(query_offsets, key_offsets)
    keys, values = (_gathered(t, key_index, len(chunks)) for t in (key, value))
    grad_query = torch.empty_like(query)
    grad_keys, grad_values = torch.empty_like(keys), torch.empty_like(values)
    for rows, cols, entries in chunks:
        mask = _chunk_mask(bias, entries, rows.stop - rows.start, query.dtype)
        grad_query[:, :, rows], grad_keys[:, :, cols], grad_values[:, :, cols] = _flash_backward(
            grad[:, rows].transpose(1, 2),
            query[:, :, rows],
            keys[:, :, cols],
            values[:, :, cols],
            out[:, rows].transpose(1, 2),
            lse[:, :, rows],
            0.0,
            False,
            attn_mask=mask,
            scale=scale,
        )
    if keys is key:
        return grad_query, grad_keys, grad_values
    return (
        grad_query,
        _scattered(grad_keys, key, key_index),
        _scattered(grad_values, key, key_index),
    )


def _scattered(grad: torch.Tensor, like: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    """The gradient of ``_gathered``: (1, H_kv, K, D) summed back onto ``like``'s n keys."""
    return torch.zeros_like(like).index_add_(2, key_index, grad)


@block_attention.register_fake
def _(query, key, value, query_offsets, key_offsets, key_index, bias, scale):
    return _empty_outputs(query)


@block_attention_backward.register_fake
def _(grad, query, key, value, out, lse, query_offsets, key_offsets, key_index, bias, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _save_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    query, key, value, query_offsets, key_offsets, key_index, bias, scale = inputs
    ctx.save_for_backward(query, key, value, *output, query_offsets, key_offsets, key_index, bias)
    ctx.scale = scale


def _backward(ctx: Any, grad: torch.Tensor, grad_lse: torch.Tensor) -> tuple:
    query, key, value, out, lse, *plan = ctx.saved_tensors
    grads = block_attention_backward(grad, query, key, value, out, lse, *plan, ctx.scale)
    return (*grads, None, None, None, None, None)


block_attention.register_autograd(_backward, setup_context=_save_for_backward)
