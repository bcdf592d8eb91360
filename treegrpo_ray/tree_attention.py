"""Tree attention through PyTorch's flex_attention, as a transformers attention implementation.

transformers' own ``flex_attention`` implementation always goes through ``torch.compile``, with
``dynamic=False``: every packed row length is a new compilation (and past dynamo's recompile
limit, the unfused fallback), and on CPU torch 2.13's Inductor template for a block mask that
reads tensors fails to compile (a C++ error). ``tree_flex`` calls ``flex_attention`` compiled
with dynamo's default (the second length compiles a dynamic-shape kernel, reused for all others)
on CUDA and unfused on the CPU, where it serves to check the block mask against the dense one.
The mask it takes is ``PackedBatch.flex_block_mask``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

TREE_FLEX = "tree_flex"


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
