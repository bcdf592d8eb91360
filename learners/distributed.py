"""Data parallelism of the learner over ``torch.distributed`` (gloo on CPU, nccl on GPU).

Every rank holds the whole batch of trees (rank 0 pulls it from the queue and broadcasts it), so
advantages, routing and the token-mean denominator are computed on the whole batch, identically on
every rank. The packed rows of a minibatch (whole trees, or the pieces of a tree over the budget)
are dealt to the ranks balanced by token count; each rank forwards and back-propagates its own
rows, then the gradients are summed over the ranks before clipping and the optimizer step, which
every rank takes alike. Gradients are summed explicitly rather than through DDP, which averages
them: the per-row losses are already divided by the whole batch's token count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def deal_rows(row_tokens: list[int], world_size: int) -> list[list[int]]:
    """Row indices per rank: largest row first, each to the rank with the fewest tokens so far
    (ties to the lower rank); each rank's rows in ascending order. row_tokens: tokens per row."""
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for row in sorted(range(len(row_tokens)), key=lambda r: (-row_tokens[r], r)):
        rank = loads.index(min(loads))
        ranks[rank].append(row)
        loads[rank] += row_tokens[row]
    return [sorted(rows) for rows in ranks]


def sum_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Replace each trainable parameter's gradient by its sum over the ranks (a rank without
    rows contributes zeros)."""
    for param in parameters:
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)


def collective_device() -> torch.device:
    """Where tensors of a collective must live: NCCL takes only CUDA tensors (on this rank's
    current device, which Ray Train sets), gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_agree(flag: bool) -> bool:
    """True only when ``flag`` is True on every rank."""
    value = torch.tensor([float(flag)], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def sum_stats(stats: dict[str, float]) -> dict[str, float]:
    """Key-wise sum of every rank's statistics."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    out: dict[str, float] = {}
    for rank_stats in gathered:
        for key, value in rank_stats.items():
            out[key] = out.get(key, 0.0) + value
    return out


def broadcast_from_first(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (pickled through the process group)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
