"""Embedded CPU engine on transformers: batched, token ids in, token ids + log-probs out.

Requests of different prefix lengths are padded into one batch; decoding uses the model's KV cache,
and a prefix cache serves the KV of prefixes computed by earlier calls. Each request samples from its own generator when its ``SamplingParams.seed`` is set, so a
request's output does not depend on which other requests share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from treegrpo_ray.actors.engines.prefix_cache import Match, PrefixCache
from treegrpo_ray.engine import GenerationRequest, GenerationResult, LoraPayload, SamplingParams


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution of one row: softmax(logits / T) restricted to the top-p nucleus.

    logits: (V,). Returns probabilities (V,) summing to 1.
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    sorted_probs[outside] = 0.0
    nucleus = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return nucleus / nucleus.sum()


class _Row:
    """Decoding state of one request inside a batch."""

    def __init__(self, request: GenerationRequest, generator: torch.Generator):
        self.request = request
        self.generator = generator
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.finish_reason: str | None = None

    def sample(self, logits: torch.Tensor) -> None:
        """Draw the next token from ``logits`` (V,) and record it with its log-prob and the exact
        entropy of the distribution it was drawn from (``-sum p log p`` over the nucleus after
        temperature; 0 for greedy, a point mass)."""
        params = self.request.params
        if params.temperature <= 0:
            token = int(torch.argmax(logits))
            logprob = torch.log_softmax(logits, dim=-1)[token]
            entropy = 0.0
        else:
            probs = nucleus_probs(logits, params.temperature, params.top_p)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
            logprob = torch.log_softmax(logits / params.temperature, dim=-1)[token]
            entropy = float(torch.special.entr(probs).sum())
        self.token_ids.append(token)
        self.logprobs.append(float(logprob))
        self.entropies.append(entropy)
        self._check_finished()

    def _check_finished(self) -> None:
        stop = self.request.stop
        if stop is not None and stop.completed(self.token_ids):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.request.params.max_new_tokens:
            self.finish_reason = "length"


class HFEngine:
    """Batched generation with a transformers causal LM on CPU (or one CUDA device).

    model: a ``PreTrainedModel`` in eval mode; pad_token_id: id used for padding; seed: seeds the
    generator used by requests without their own seed; cache_bytes: memory budget of the prefix
    KV cache (0 turns it off).

    Prefix caching: every request looks up the longest prefix of its tokens already computed (a
    radix tree over token ids, ``PrefixCache``) and only its remaining tokens go through the model.
    A batch lays each row out as ``[pad][cached KV][pad][new tokens]``: the cached parts, of
    different lengths, are right-aligned in the past KV, the new parts right-aligned in the input,
    with explicit position ids and an attention mask that hides both pads. After decoding, each
    row's KV (prefix + generated tokens but the last, which was never fed) is inserted.
    """

    def __init__(
        self, model: PreTrainedModel, pad_token_id: int, seed: int = 0, cache_bytes: int = 0
    ):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(seed)
        self.max_positions = int(model.config.max_position_embeddings)
        self.version = 0
        self.cache = PrefixCache(cache_bytes)

    def load_weights(self, version: int, payload: dict[str, torch.Tensor] | LoraPayload) -> None:
        """Switch to policy ``version``: a full state dict, or a LoRA adapter applied to the
        weights the engine started with. The prefix cache starts empty."""
        if isinstance(payload, LoraPayload):
            self._load_adapter(payload)
        else:
            self._drop_adapter()
            self.model.load_state_dict(payload)
        self.version = version
        self.cache.reset(version)

    def _load_adapter(self, payload: LoraPayload) -> None:
        """Wrap the model with the adapter's LoRA layers (once) and load its tensors; the adapter
        is merged into the weights so decoding costs what the plain model costs."""
        from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict

        if isinstance(self.model, PeftModel):
            self.model.unmerge_adapter()
        else:
            config = LoraConfig.from_peft_type(**payload.peft_config)
            self.model = get_peft_model(self.model, config).eval()
        set_peft_model_state_dict(self.model, payload.adapter_state)
        self.model.merge_adapter()

    def _drop_adapter(self) -> None:
        """Back to the plain model (a full state dict replaces the whole policy)."""
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            self.model.unmerge_adapter()
            self.model = self.model.unload()

    def cache_stats(self) -> dict[str, float]:
        """Prefill / cache counters since start (see ``CacheStats``)."""
        return self.cache.stats.to_dict()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Continue every request's prefix; results come back in request order."""
        results: list[GenerationResult | None] = [None] * len(requests)
        runnable = []
        for i, request in enumerate(requests):
            if len(request.prefix_ids) >= self.max_positions:
                results[i] = GenerationResult([], [], "context", prefill_tokens=0, entropies=[])
            else:
                runnable.append(i)
        if runnable:
            batch = [requests[i] for i in runnable]
            for i, result in zip(runnable, self._generate_batch(batch), strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    def _row_generator(self, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        return torch.Generator().manual_seed(params.seed)

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        rows = [_Row(r, self._row_generator(r.params)) for r in requests]
        prefill = self._prefill(requests)
        logits, cache, attention_mask = prefill.logits, prefill.cache, prefill.attention_mask
        positions = torch.tensor([len(r.prefix_ids) - 1 for r in requests])
        max_steps = max(r.params.max_new_tokens for r in requests)
        for _ in range(max_steps):
            for row, row_logits in zip(rows, logits, strict=True):
                if row.finish_reason is None:
                    row.sample(row_logits)
            positions += 1
            for row, position in zip(rows, positions.tolist(), strict=True):
                if row.finish_reason is None and position >= self.max_positions - 1:
                    row.finish_reason = "context"
            if all(row.finish_reason is not None for row in rows):
                break
            next_ids = torch.tensor(
                [row.token_ids[-1] if row.token_ids else self.pad_token_id for row in rows]
            )
            attention_mask = torch.cat(
                [attention_mask, torch.ones(len(rows), 1, dtype=torch.long)], 1
            )
            logits = self._forward(next_ids[:, None], attention_mask, positions[:, None], cache)
        self._remember(rows, prefill.cached, cache, attention_mask)
        return [
            GenerationResult(
                token_ids=row.token_ids,
                logprobs=row.logprobs,
                finish_reason=row.finish_reason or "length",
                prefill_tokens=len(row.request.prefix_ids) - cached,
                cached_tokens=cached,
                entropies=row.entropies,
            )
            for row, cached in zip(rows, prefill.cached, strict=True)
        ]

    def _prefill(self, requests: list[GenerationRequest]) -> _Prefill:
        """Run the uncached part of every prefix (at least its last token) through the model."""
        matches = [self.cache.match(r.prefix_ids[:-1]) for r in requests]
        cached = [m.length for m in matches]
        new = [r.prefix_ids[c:] for r, c in zip(requests, cached, strict=True)]
        past, width = max(cached), max(len(ids) for ids in new)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((len(requests), width), dtype=torch.long)
        attention_mask = torch.zeros((len(requests), past + width), dtype=torch.long)
        for i, (c, ids) in enumerate(zip(cached, new, strict=True)):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            position_ids[i, width - len(ids) :] = torch.arange(c, c + len(ids))
            attention_mask[i, past - c : past] = 1
            attention_mask[i, past + width - len(ids) :] = 1
            self.cache.stats.prefill_tokens += len(ids)
            self.cache.stats.cached_tokens += c
        cache = self._past_cache(matches, past)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        return _Prefill(logits, cache, attention_mask, cached)

    def _past_cache(self, matches: list[Match], past: int) -> DynamicCache:
        """A batch cache with each row's cached KV right-aligned in ``past`` slots (zeros before):
        per layer ``(B, kv_heads, past, head_dim)``."""
        if past == 0:
            return DynamicCache()
        heads, _, dim = next(m for m in matches if m.length).pieces[0][0][0].shape
        layers = []
        for layer in range(self.model.config.num_hidden_layers):
            shape = (len(matches), heads, past, dim)
            keys = torch.zeros(shape, dtype=self.model.dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.model.dtype, device=self.device)
            for i, match in enumerate(matches):
                at = past - match.length
                for piece in match.pieces:
                    key, value = piece[layer]
                    keys[i, :, at : at + key.shape[1]] = key
                    values[i, :, at : at + key.shape[1]] = value
                    at += key.shape[1]
            layers.append((keys, values))
        return DynamicCache(ddp_cache_data=layers)

    def _remember(
        self, rows: list[_Row], cached: list[int], cache: DynamicCache, attention_mask: torch.Tensor
    ) -> None:
        """Insert each row's prefix + fed tokens; only the KV past its cached part is gathered,
        from the row's real (unmasked) slots, in one gather per layer."""
        if not self.cache.enabled:
            return
        ids = [row.request.prefix_ids + tuple(row.token_ids[:-1]) for row in rows]
        slots = [
            mask.nonzero().squeeze(-1)[c : len(row_ids)]
            for mask, c, row_ids in zip(attention_mask, cached, ids, strict=True)
        ]
        longest = max(len(s) for s in slots)
        if longest == 0:
            return
        index = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row_slots in enumerate(slots):
            index[i, : len(row_slots)] = row_slots
        new_kv = [self._gather(layer, index.to(self.device)) for layer in cache.layers]
        for i, (row_ids, c, row_slots) in enumerate(zip(ids, cached, slots, strict=True)):
            kv = [(k[i, :, : len(row_slots)], v[i, :, : len(row_slots)]) for k, v in new_kv]
            self.cache.insert(row_ids, kv, start=c)

    @staticmethod
    def _gather(layer: Any, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``index`` (B, S) slots of each row: (B, kv_heads, S, head_dim)."""
        batch, heads, _, dim = layer.keys.shape
        expanded = index[:, None, :, None].expand(batch, heads, index.shape[1], dim)
        return layer.keys.gather(2, expanded), layer.values.gather(2, expanded)

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """Logits of the last position: (B, V) as float32 on the CPU."""
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            position_ids=position_ids.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the LM head only where the next token is drawn
        )
        return out.logits[:, -1, :].float().cpu()


@dataclass
class _Prefill:
    """logits: (B, V) of each row's last prefix token; cache / attention_mask: (B, ..., P) state
    after the prefix; cached: prefix tokens per row that came from the prefix cache."""

    logits: torch.Tensor
    cache: DynamicCache
    attention_mask: torch.Tensor
    cached: list[int]
