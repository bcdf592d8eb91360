"""KV memory of the embedded engine: preallocated per-sequence slots written in place.

transformers' ``DynamicCache`` concatenates every new key and value onto the whole past at each
decode step (a copy of the batch's KV per layer per token) and its SDPA path repeats the grouped
KV heads for every query head (another copy); a padded batch also keeps feeding finished rows. On
CPU, where decoding a small model is bound by memory traffic, that put the decode step 7-11x
above its memory roofline (issue 27). Here each running sequence owns a slot: per layer a
``(slots, kv_heads, capacity, head_dim)`` buffer for keys and one for values, allocated once
and grown only when a longer sequence arrives. A forward writes each row's new tokens at that
row's own columns, and attention reads the rows' prefixes as views of the buffers, grouped heads
sharing their KV (``slot_attention``: measured here, repeating the KV heads cost more than the
attention itself). Rows are kept compact (row i in slot i).

A forward's tokens are packed in one sequence ``(1, T)``, without padding: one token of each
decoding row first, then the new tokens (the uncached prefix) of each row that joins. So rows
join in the forward that decodes the others, as vLLM schedules them: a prefill of its own read
every weight once more for a few tokens (15 new tokens cost about what a decode step of 26 rows
did, issue 27). ``SlotPlan`` says where each row's tokens are.

``SlotKV`` is handed to the model as ``past_key_values``: Llama / Qwen2 attention layers call
only ``update(key_states, value_states, layer_idx)`` when the attention mask is given as a 4D
tensor (transformers 5.20, ``masking_utils._preprocess_mask_arguments`` returns it unchanged),
and hand the forward's extra keyword arguments to the attention function: the model runs
``slot_attention`` (``attending_through_slots``) with the plan as ``slot_plan``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from treegrpo_ray.kernels.decode_attention import DecodeAttentionKernel

SLOT_ATTENTION = "treegrpo_slots"
# the model's attention mask: transformers hands a 4D one on as it is, and slot_attention reads
# the plan's masks instead
NO_MASK = torch.zeros(1, 1, 1, 1)


@dataclass(frozen=True)
class Joining:
    """A row feeding several tokens (its uncached prefix) in a packed forward: its slot, the
    span ``start..start+count-1`` of its tokens in the packed sequence, and its causal mask
    ``(1, 1, count, width)`` (additive) over the columns ``0..width-1`` it attends."""

    slot: int
    start: int
    count: int
    width: int
    mask: torch.Tensor


@dataclass(frozen=True)
class SlotPlan:
    """Where a packed forward's tokens are: the first ``decoding`` are one token each of the
    rows in slots ``0..decoding-1``; the rest are the tokens of the ``joining`` rows. The
    decoding rows attend through ``decode_kernel`` (the row in slot r over its first
    ``decode_counts[r]`` columns), or without it as one batch over the first ``decode_width``
    columns with ``decode_mask`` ``(decoding, 1, 1, decode_width)`` (additive)."""

    decoding: int
    decode_width: int
    decode_mask: torch.Tensor | None
    joining: tuple[Joining, ...]
    decode_counts: torch.Tensor | None = None
    decode_kernel: DecodeAttentionKernel | None = None


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    slot_plan: SlotPlan | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Masked attention of a packed forward over KV views of the slots, grouped heads reading
    their KV in place.

    query: (1, H, T, D), the forward's T tokens as ``slot_plan`` places them; key, value: a
    layer's whole buffers (slots, Hkv, capacity, D), H = G * Hkv (query head h reads KV head
    h // G, as ``repeat_kv``, but without repeating); attention_mask: unused (``NO_MASK``).
    Returns the output as (1, T, H, D) and no weights, as transformers' attention functions do.

    The G query heads of a KV head attend as G queries of one head, so each KV head is read once
    per row (``enable_gqa`` has the kernel read it once per query head). On CPU, 16 decode rows
    of ~250 tokens, SmolLM2's heads: 22.9 ms over 30 layers, against 26.6 ms with ``enable_gqa``
    and the boolean mask (issue 27). Where the plan has a ``decode_kernel``, the decoding rows
    attend through it instead, each over its own columns only (not the longest row's, masked)."""
    assert slot_plan is not None, "slot_attention reads the forward's SlotPlan (SlotKV.begin)"
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    group = heads // kv_heads
    outputs = []
    if slot_plan.decoding:
        rows, width = slot_plan.decoding, slot_plan.decode_width
        grouped = query[0, :, :rows].transpose(0, 1).reshape(rows, kv_heads, group, dim)
        if slot_plan.decode_kernel is not None and slot_plan.decode_counts is not None:
            scale = dim**-0.5 if scaling is None else scaling
            out = slot_plan.decode_kernel.attend(
                grouped, key, value, slot_plan.decode_counts, scale
            )
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                grouped,
                key[:rows, :, :width],
                value[:rows, :, :width],
                attn_mask=slot_plan.decode_mask,
                scale=scaling,
            )
        outputs.append(out.reshape(rows, heads, dim))
    for row in slot_plan.joining:
        count = row.count
        grouped = query[:, :, row.start : row.start + count].reshape(
            1, kv_heads, group * count, dim
        )
        mask = row.mask.expand(1, group, count, -1).reshape(1, 1, group * count, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped,
            key[row.slot : row.slot + 1, :, : row.width],
            value[row.slot : row.slot + 1, :, : row.width],
            attn_mask=mask,
            scale=scaling,
        )
        outputs.append(out.view(heads, count, dim).transpose(0, 1))
    return torch.cat(outputs)[None], None


def token_places(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed token's slot and column (= position): the row in slot r feeds ``counts[r]``
    tokens at columns ``starts[r]..``, packed in slot order. starts, counts: (k,) int64.
    Returns (T,) and (T,), T = counts.sum()."""
    slots = torch.repeat_interleave(torch.arange(len(counts)), counts)
    row_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    positions = torch.repeat_interleave(starts, counts) + torch.arange(len(slots)) - row_start
    return slots, positions


@contextlib.contextmanager
def attending_through_slots(config: Any) -> Iterator[None]:
    """Within the block, the model of ``config`` attends with ``slot_attention``; outside, as
    it was loaded (a caller may still run the same model itself, e.g. as a reference)."""
    from transformers import AttentionInterface

    if SLOT_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    previous = config._attn_implementation
    config._attn_implementation = SLOT_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


class SlotKV:
    """Per-layer key and value buffers ``(slots, kv_heads, capacity, head_dim)``.

    A token's column is its position on its own path, so a slot holds its sequence from column 0.
    Before each forward the engine calls ``begin(starts, counts, decoding)``: the row in slot r
    feeds ``counts[r]`` new tokens at columns ``starts[r]..``, packed in slot order, the first
    ``decoding`` rows one token each. ``update`` then writes them and returns a layer's buffers,
    which ``slot_attention`` reads through the plan ``begin`` returned. decode_kernel: the
    decoding rows attend through it where it takes the buffers (None: torch's attention).
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_capacity: int = 2**62,
        decode_kernel: DecodeAttentionKernel | None = None,
    ):
        self.shape = (0, kv_heads, 0, head_dim)
        if decode_kernel is not None and not decode_kernel.takes(dtype, device, head_dim):
            decode_kernel = None
        self.decode_kernel = decode_kernel
        self.max_capacity = max_capacity  # no slot grows past it (the engine's positions)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = [self._empty() for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._empty() for _ in range(layers)]
        self._index: torch.Tensor | None = None  # the new tokens' rows in a flat buffer view

    def _empty(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    @property
    def slots(self) -> int:
        return self.shape[0]

    @property
    def capacity(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def token_bytes(self) -> int:
        """Bytes of KV one token takes over all layers."""
        _, heads, _, dim = self.shape
        return 2 * len(self.keys) * heads * dim * self.keys[0].element_size()

    def grown(self, slots: int, capacity: int) -> tuple[int, int]:
        """The (slots, capacity) that ``reserve(slots, capacity)`` leaves: what is there, or
        more; a grown capacity takes half again what is asked (up to ``max_capacity``), so
        growth stays rare."""
        old_slots, _, old_capacity, _ = self.shape
        if capacity > old_capacity:
            capacity = max(old_capacity, min(capacity + capacity // 2, self.max_capacity))
        return max(slots, old_slots), max(capacity, old_capacity)

    def bytes_for(self, slots: int, capacity: int) -> int:
        """Bytes the buffers hold at ``slots`` x ``capacity``."""
        return slots * capacity * self.token_bytes()

    def reserve(self, slots: int, capacity: int) -> None:
        """At least ``slots`` slots of ``capacity`` columns, keeping what is written
        (``grown``)."""
        old_slots, heads, old_capacity, dim = self.shape
        if slots <= old_slots and capacity <= old_capacity:
            return
        new_slots, new_capacity = self.grown(slots, capacity)
        self.shape = (new_slots, heads, new_capacity, dim)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = self._empty()
                if old_slots and old_capacity:
                    new[:old_slots, :, :old_capacity] = old
                buffers[i] = new

    def shrink(self, slots: int) -> None:
        """Keep the first ``slots`` slots only (their KV kept), freeing the others' memory."""
        if slots >= self.slots:
            return
        self.shape = (slots, *self.shape[1:])
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                buffers[i] = old[:slots].clone()

    def begin(
        self, starts: torch.Tensor, counts: torch.Tensor, decoding: int
    ) -> tuple[torch.Tensor, SlotPlan]:
        """Place the next forward's tokens; returns its ``(1, T)`` position ids and its plan.

        starts, counts: (k,) long, for the rows in slots 0..k-1: the row in slot r feeds
        ``counts[r]`` tokens at positions (= columns) ``starts[r]..``, each seeing the columns up to
        its own; the first ``decoding`` rows feed one token each. T = counts.sum()."""
        slots, positions = token_places(starts, counts)
        _, heads, capacity, _ = self.shape
        rows = slots[None, :] * heads + torch.arange(heads)[:, None]  # (Hkv, T), as update's
        self._index = (rows * capacity + positions).flatten().to(self.device)
        return positions[None].to(self.device), self._plan(starts, counts, decoding)

    def _plan(self, starts: torch.Tensor, counts: torch.Tensor, decoding: int) -> SlotPlan:
        """The ``SlotPlan`` of ``begin``'s rows, with their masks on the device."""
        lengths = starts[:decoding]
        width = int(lengths.max()) + 1 if decoding else 0
        decode_mask = decode_counts = None
        if decoding and self.decode_kernel is not None:
            decode_counts = lengths + 1
        elif decoding:
            hidden = torch.arange(width) > lengths[:, None]  # (decoding, width)
            decode_mask = self._additive(hidden)[:, None, None]
        joining, at = [], decoding
        for slot in range(decoding, len(counts)):
            start, count = int(starts[slot]), int(counts[slot])
            hidden = torch.arange(start + count) > start + torch.arange(count)[:, None]
            mask = self._additive(hidden)[None, None]
            joining.append(Joining(slot, at, count, start + count, mask))
            at += count
        return SlotPlan(
            decoding, width, decode_mask, tuple(joining), decode_counts, self.decode_kernel
        )

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        """-inf where ``hidden``, 0 elsewhere, in the buffers' dtype, on their device."""
        mask = torch.zeros(hidden.shape, dtype=self.dtype).masked_fill_(hidden, float("-inf"))
        return mask.to(self.device)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' KV (1, Hkv, T, D) and return the layer's buffers (slots, Hkv,
        capacity, D): ``slot_attention`` reads each row's columns through the plan."""
        assert self._index is not None, "begin() places the tokens of a forward"
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        dim = self.shape[3]
        # one index_copy_ into the flat (slots * kv_heads * capacity, D) view: ~10x faster than
        # assigning through advanced indexing (a decode step's 2 x layers writes, issue 27)
        keys.view(-1, dim).index_copy_(0, self._index, key_states.reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, self._index, value_states.reshape(-1, dim))
        return keys, values

    def write(self, slot: int, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy per-layer KV ``(kv_heads, n, head_dim)`` into ``slot`` at columns ``start..``."""
        for layer, (key, value) in enumerate(kv):
            n = key.shape[1]
            self.keys[layer][slot, :, start : start + n] = key
            self.values[layer][slot, :, start : start + n] = value

    def read(self, slot: int, start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of ``slot``'s KV at columns ``start..stop-1``, per layer ``(kv_heads, n, D)``."""
        return [
            (k[slot, :, start:stop], v[slot, :, start:stop])
            for k, v in zip(self.keys, self.values, strict=True)
        ]

    def move(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` columns of ``source`` into ``target`` (compaction)."""
        for buffer in self.keys + self.values:
            buffer[target, :, :length] = buffer[source, :, :length]
