"""KV memory of the embedded engine: preallocated per-sequence slots written in place.

transformers' ``DynamicCache`` concatenates every new key and value onto the whole past at each
decode step (a copy of the batch's KV per layer per token) and its SDPA path repeats the grouped
KV heads for every query head (another copy); a padded batch also keeps feeding finished rows. On
CPU, where decoding a small model is bound by memory traffic, that put the decode step 7-11x
above its memory roofline (issue 27). Here each running sequence owns a slot: per layer a
``(slots, kv_heads, capacity, head_dim)`` buffer for keys and one for values, allocated once
and grown only when a longer sequence arrives. A step writes each row's new token at that row's
own length, and attention reads the rows' prefixes as views of the buffers, grouped heads
sharing their KV (``slot_attention``: measured here, repeating the KV heads cost more than the
attention itself). Rows are kept compact (row i in slot i), so a decode
batch is the buffers' first n slots.

``SlotKV`` is handed to the model as ``past_key_values``: Llama / Qwen2 attention layers call
only ``update(key_states, value_states, layer_idx)`` when the attention mask is given as a 4D
tensor (transformers 5.20, ``masking_utils._preprocess_mask_arguments`` returns it unchanged).
The model must run ``slot_attention`` (``attending_through_slots``), which takes that mask as an
additive ``(B, 1, q, L)`` tensor, 0 where a query may attend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

SLOT_ATTENTION = "treegrpo_slots"


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Masked attention over KV views of the slots, grouped heads reading their KV in place.

    query: (B, H, q, D); key, value: (B, Hkv, L, D), H = G * Hkv (query head h reads KV head
    h // G, as ``repeat_kv``, but without repeating); attention_mask: (B, 1, q, L) additive
    (0 where a query may attend, -inf elsewhere). Returns the output as (B, q, H, D) and no
    weights, as transformers' attention functions do.

    The G query heads of a KV head attend as G * q queries of one head, so each KV head is read
    once per row (``enable_gqa`` has the kernel read it once per query head). On CPU, 16 decode
    rows of ~250 tokens, SmolLM2's heads: 22.9 ms over 30 layers, against 26.6 ms with
    ``enable_gqa`` and the boolean mask (issue 27)."""
    batch, heads, width_q, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * width_q, dim)
    mask = attention_mask.expand(batch, heads // kv_heads, width_q, -1).reshape(
        batch, 1, heads // kv_heads * width_q, -1
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, scale=scaling
    )
    return out.view(batch, heads, width_q, dim).transpose(1, 2).contiguous(), None


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
    The last column is scratch: the padding queries of a batched prefill write there, and no
    sequence reaches it (``capacity`` covers the longest one plus one).
    Before each forward the engine calls ``begin(first, starts, counts)``: rows ``first..first+k-1``
    each feed ``counts[r]`` new tokens at columns ``starts[r]..``, left-padded to the longest so
    that every row's last token comes last (decoding: every count 1). ``update`` then writes them
    and returns the KV the queries attend over.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_capacity: int = 2**62,
    ):
        self.shape = (0, kv_heads, 0, head_dim)
        self.max_capacity = max_capacity  # no slot grows past it (the engine's positions + 1)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = [self._empty() for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._empty() for _ in range(layers)]
        self._rows = slice(0, 0)
        self._index: torch.Tensor | None = None  # the new tokens' rows in a flat buffer view
        self._width = 0

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
        """At least ``slots`` slots of ``capacity`` columns (scratch included), keeping what is
        written (``grown``)."""
        old_slots, heads, old_capacity, dim = self.shape
        if slots <= old_slots and capacity <= old_capacity:
            return
        new_slots, new_capacity = self.grown(slots, capacity)
        self.shape = (new_slots, heads, new_capacity, dim)
        kept = old_capacity - 1  # the old scratch column is not kept
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = self._empty()
                if old_slots and kept > 0:
                    new[:old_slots, :, :kept] = old[:, :, :kept]
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
        self, first: int, starts: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Place the next forward's tokens; returns its ``(attention_mask, position_ids)``.

        starts, counts: (k,) long. Query i of row r (of Q = max(counts)) is real when
        i >= Q - counts[r], at position starts[r] + i - (Q - counts[r]); it sees the columns up
        to its position. A padding query writes to the scratch column and sees the row's first
        new token only (a row of the mask is never empty). Returns a (k, 1, Q, W) additive mask
        (``slot_attention``), W = max(starts + counts), and (k, Q) long position ids (0 on
        padding)."""
        k, width_q = len(starts), int(counts.max())
        offsets = torch.arange(width_q) - (width_q - counts[:, None])  # (k, Q), < 0 on padding
        real = offsets >= 0
        positions = torch.where(real, starts[:, None] + offsets, 0)
        columns = torch.where(real, positions, self.capacity - 1)
        self._width = int((starts + counts).max())
        keys = torch.arange(self._width)
        seen = torch.where(
            real[..., None], keys <= positions[..., None], keys == starts[:, None, None]
        )
        mask = torch.zeros(seen.shape, dtype=self.dtype).masked_fill_(~seen, float("-inf"))
        _, heads, capacity, _ = self.shape
        rows = torch.arange(first, first + k)[:, None, None] * heads + torch.arange(heads)[:, None]
        self._rows = slice(first, first + k)
        self._index = (rows * capacity + columns[:, None, :]).flatten().to(self.device)
        return mask[:, None].to(self.device), positions.to(self.device)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' KV (k, Hkv, Q, D) and return the rows' KV (k, Hkv, W, D)."""
        assert self._index is not None, "begin() places the tokens of a forward"
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        dim = self.shape[3]
        # one index_copy_ into the flat (slots * kv_heads * capacity, D) view: ~10x faster than
        # assigning through advanced indexing (a decode step's 2 x layers writes, issue 27)
        keys.view(-1, dim).index_copy_(0, self._index, key_states.reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, self._index, value_states.reshape(-1, dim))
        return keys[self._rows, :, : self._width], values[self._rows, :, : self._width]

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
