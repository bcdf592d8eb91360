"""The learner's forward maths: per-token log-probs of a policy on path rows or on packed trees
(each token sees its ancestors only), and the attention kernel a device takes."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import torch

from treegrpo_ray.errors import UserInputError
from treegrpo_ray.packing import PackedBatch, TreeBlockPlan
from treegrpo_ray.tree_attention import TREE_BLOCK, TREE_BLOCKS, TREE_FLEX

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


# A policy: a transformers PreTrainedModel, or a peft PeftModel around one. Both forward
# attributes at run time (config, get_base_model, disable_adapter, peft_config...) that their
# stubs do not show through torch.nn.Module, so code that reads them takes it untyped.
Policy = Any


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each next-token distribution, on a
    path-expanded batch (the reference layout, ``packing.expand_paths``).

    input_ids, attention_mask: (B, T). Returns ``(logprobs, entropy)``, both (B, T-1), under
    ``softmax(logits / temperature)`` (the distribution the rollout sampled from).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    row: int,
    temperature: float = 1.0,
    mask_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each action token of packed ``row`` given its own path, and the entropy of the
    distribution it was drawn from, in one forward of the row's real tokens with the tree mask.

    Action token t reads the logits at ``batch.prev_index[row, t]``; the LM head runs only at
    those positions (``logits_to_keep``). Returns ``(logprobs, entropy)``, both (T,) float32 on
    the batch's device, 0 off action tokens, under ``softmax(logits / temperature)``. The model
    must use ``sdpa``, ``eager``, ``tree_flex`` or ``tree_blocks`` (``treegrpo_ray.tree_attention``;
    see ``treegrpo_ray.packing``); a dense or block tree mask is built in ``mask_dtype`` (default:
    the model's), the dtype its attention computes in.
    """
    n = batch.row_length(row)
    input_ids = batch.input_ids[row, :n]
    (pos,) = batch.loss_mask[row].nonzero(as_tuple=True)
    # logits only where an action token is predicted (a branch point predicts several)
    predictors, which = torch.unique(batch.prev_index[row, pos], return_inverse=True)
    logits = model(
        input_ids=input_ids[None],
        **_tree_attention_inputs(model, batch, row, mask_dtype),
        position_ids=batch.position_ids[row, None, :n],
        use_cache=False,
        logits_to_keep=predictors,
    ).logits[0]
    log_probs = torch.log_softmax(logits[which].float() / temperature, -1)
    action_logprobs = log_probs.gather(-1, input_ids[pos, None]).squeeze(-1)
    action_entropy = -(log_probs.exp() * log_probs).sum(-1)
    width = batch.input_ids.shape[1]
    logprobs = torch.zeros(width, device=pos.device).index_put((pos,), action_logprobs)
    entropy = torch.zeros(width, device=pos.device).index_put((pos,), action_entropy)
    return logprobs, entropy


def _tree_attention_inputs(
    model: Policy, batch: PackedBatch, row: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor | BlockMask | TreeBlockPlan | None]:
    """The tree mask of packed ``row`` as the forward's keyword arguments, in the form
    ``model``'s attention takes."""
    attention = model.config._attn_implementation
    dtype = dtype or next(model.parameters()).dtype
    if attention == TREE_FLEX:
        return {"attention_mask": batch.flex_block_mask(row)}
    if attention == TREE_BLOCKS:
        return {
            "attention_mask": None,
            "tree_blocks": batch.tree_block_plan(row, dtype, TREE_BLOCK),
        }
    if attention not in ("sdpa", "eager"):
        raise ValueError(
            f"packed training needs sdpa, eager, {TREE_FLEX} or {TREE_BLOCKS} attention (a tree "
            f"mask), the model uses {attention}; set ppo.attention"
        )
    return {"attention_mask": batch.attention_bias(row, dtype)}


def compile_decoder_layers(model: Policy) -> None:
    """Compile each decoder layer of ``model`` (a transformers model, or peft around one) in
    place, with dynamic shapes (rows vary in length): the layers share code and weights enter as
    inputs, so one graph (per grad mode and adapter state) serves them all. Raises
    ``UserInputError`` where inductor cannot build CPU kernels (no C++ compiler)."""
    if next(model.parameters()).device.type == "cpu" and shutil.which("c++") is None:
        raise UserInputError(
            "ppo.compile_layers needs a C++ compiler on the learner's node (inductor builds its "
            "CPU kernels with it; `c++` is not on PATH): install one (e.g. apt install g++) or "
            "set ppo.compile_layers=false"
        )
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise UserInputError(
            f"ppo.compile_layers: {type(model).__name__} names no decoder layer class "
            "(_no_split_modules); set ppo.compile_layers=false"
        )
    for layer in layers:
        layer.compile(dynamic=True)


def attention_implementation(setting: str, device: torch.device) -> str:
    """transformers' ``attn_implementation`` for ``ppo.attention`` on ``device``."""
    if setting == "flex" and device.type != "cuda":
        raise UserInputError(
            f"ppo.attention=flex needs a CUDA learner (this one is on {device.type}): PyTorch's "
            "flex_attention has no backward pass there; set ppo.attention to auto or sdpa"
        )
    if setting == "blocks" and device.type == "cuda":
        raise UserInputError(
            "ppo.attention=blocks is the CPU's block-sparse kernel; on CUDA set ppo.attention to "
            "auto or flex (flex_attention skips the hidden blocks there)"
        )
    if setting in ("flex", "auto") and device.type == "cuda":
        return TREE_FLEX
    return TREE_BLOCKS if setting == "blocks" else "sdpa"
