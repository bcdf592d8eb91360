"""Embedded CPU engine on transformers: token ids in, token ids + log-probs out, continuously
batched.

Requests wait in a queue and join the running batch as soon as a slot is free; every ``step``
is one forward that feeds the running rows one token each and the joining rows their uncached
prefixes, and a row that finishes leaves the batch at once (its KV goes to the prefix cache), so
the batch stays full across requests of any length. KV lives in
preallocated slots written in place (``slot_kv.SlotKV``), and the prefix cache serves the KV of
prefixes computed by earlier requests. Each request samples from its own generator when its
``SamplingParams.seed`` is set, so a request's tokens do not depend on which other requests share
its batch, nor on when it joined.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from treegrpo_ray.actors.engines.lean_forward import LeanForward
from treegrpo_ray.actors.engines.prefix_cache import PrefixCache
from treegrpo_ray.actors.engines.slot_kv import NO_MASK, SlotKV, attending_through_slots
from treegrpo_ray.engine import EngineCounters, GenerationRequest, GenerationResult, LoraPayload
from treegrpo_ray.kernels import decode_attention, decoder_ops, small_rows_linear
from treegrpo_ray.memory_plan import near_kill_threshold
from treegrpo_ray.onednn_linear import OneDNNLinears, onednn_available

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class ForwardTrace:
    """One forward of the engine (``HFEngine.trace``): ``decode`` (the running rows, one token
    each), ``prefill`` (rows that join an empty batch) or ``mixed`` (both); rows computed, tokens
    fed, KV tokens attended over (the rows' lengths after it), seconds."""

    kind: str
    rows: int
    tokens: int
    context: int
    seconds: float


class _Row:
    """Decoding state of one request: its tokens so far and the KV its slot holds.

    length: tokens whose KV is in the slot (the prefix, then every sampled token but the last,
    which is fed at the next step); cached: prefix tokens that came from the prefix cache;
    shared: prefix tokens copied from a row that joined with the same prefix (not computed)."""

    def __init__(self, request: GenerationRequest, generator: torch.Generator, tag: Hashable):
        self.request = request
        self.generator = generator
        self.tag = tag
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.finish_reason: str | None = None
        self.length = 0
        self.cached = 0
        self.shared = 0

    def record(self, token: int, logprob: float, entropy: float, max_positions: int) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.entropies.append(entropy)
        stop = self.request.stop
        if stop is not None and stop.completed(self.token_ids):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.request.params.max_new_tokens:
            self.finish_reason = "length"
        elif self.length >= max_positions - 1:  # the new token's position: no room after it
            self.finish_reason = "context"

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "length",
            prefill_tokens=len(self.request.prefix_ids) - self.cached - self.shared,
            cached_tokens=self.cached + self.shared,
            entropies=self.entropies,
        )


def _distinct_prefixes_first(rows: list[_Row]) -> tuple[list[_Row], int]:
    """``rows`` with the first row of each distinct prefix first (in order), the rows repeating
    an earlier prefix after them (in order); and how many are distinct."""
    seen: set[tuple[int, ...]] = set()
    first: list[_Row] = []
    repeated: list[_Row] = []
    for row in rows:
        prefix = row.request.prefix_ids
        (repeated if prefix in seen else first).append(row)
        seen.add(prefix)
    return first + repeated, len(first)


def sample_rows(rows: list[_Row], logits: torch.Tensor) -> list[tuple[int, float, float]]:
    """Draw each row's next token from its logits row (n, V), each from its own generator.

    Returns ``(token, logprob, entropy)`` per row: the log-prob under ``softmax(logits / T)``
    (T = 1 for greedy rows) and the exact entropy of the distribution drawn from (the nucleus
    after temperature; 0 for greedy, a point mass). The softmax runs batched. A full-vocabulary
    draw is by inverse CDF: one uniform from the row's generator located in the row's cumulative
    probabilities (float64), a search instead of ``multinomial``'s exponential draw per
    vocabulary entry (~1 ms a row here); so a row's token depends on its own logits and
    generator alone."""
    temperatures = torch.tensor(
        [r.request.params.temperature if r.request.params.temperature > 0 else 1.0 for r in rows]
    )
    log_probs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    probs = log_probs.exp()
    # -p log p as a product of the two tensors at hand: ~5x faster than special.entr here; nansum
    # drops 0 * -inf (a -inf logit), whose entr is 0
    entropies = (-(probs * log_probs).nansum(-1)).tolist()
    tokens = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.request.params.temperature <= 0]
    if greedy:
        for i, token in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist(), strict=True):
            tokens[i] = token
    full = [
        i
        for i, r in enumerate(rows)
        if r.request.params.temperature > 0 and r.request.params.top_p >= 1.0
    ]
    if full:
        cdf = probs[full].double().cumsum(-1)
        uniform = torch.cat(
            [torch.rand(1, generator=rows[i].generator, dtype=torch.float64) for i in full]
        )
        drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
        for i, token in zip(
            full, drawn.clamp(max=logits.shape[-1] - 1)[:, 0].tolist(), strict=True
        ):
            tokens[i] = token
    out = []
    for i, row in enumerate(rows):
        params = row.request.params
        if params.temperature <= 0:
            entropies[i] = 0.0
        elif params.top_p < 1.0:
            nucleus = nucleus_probs(logits[i], params.temperature, params.top_p)
            tokens[i] = int(torch.multinomial(nucleus, 1, generator=row.generator))
            entropies[i] = float(torch.special.entr(nucleus).sum())
        out.append((tokens[i], float(log_probs[i, tokens[i]]), entropies[i]))
    return out


class HFEngine:
    """Continuously batched generation with a transformers causal LM on CPU (or one CUDA device).

    model: a ``PreTrainedModel`` (Llama / Qwen2 attention; the engine's forwards run it with
    ``slot_attention``); pad_token_id: kept for callers (rows are never padded);
    seed: seeds the generator of requests without their own seed; cache_bytes: memory budget of
    the prefix KV cache (0 turns it off); max_num_seqs: sequences decoded at once (more wait);
    max_kv_bytes: most bytes the running rows' KV slots may take (None: no bound); a request
    that would take them past it waits for rows to finish, unless it would run alone;
    onednn_linears: on CPU, compute the linear layers through oneDNN with prepacked weights
    (``treegrpo_ray.onednn_linear``: ~2x torch's MKL path on AMD CPUs, for a second copy of
    the weights); small_rows_kernel: with onednn_linears, forwards of at most 32 rows compute
    them through ``treegrpo_ray.kernels.small_rows_linear`` on CPUs where it pays off and
    builds (a third copy of the weights); decode_attention_kernel: on CPU, the decoding rows
    attend through ``treegrpo_ray.kernels.decode_attention`` where it builds; lean_forward: on
    CPU, the forwards of Llama / Qwen2 models run ``lean_forward.LeanForward`` instead of the
    model's own where it can (the packed linears, the attention kernel and
    ``treegrpo_ray.kernels.decoder_ops`` built); max_model_len:
    the longest sequence (prefix + generated) a row may reach, it finishes there with
    "context" (None: the model's ``max_position_embeddings``); it bounds each KV slot;
    memory_pressed: says when the node nears the memory at which Ray kills workers (None:
    never asked): then no request joins while rows run, one at a time when none
    does, and the KV slots shrink to the running rows (``memory_throttles`` counts those steps).

    ``generate`` runs a list of requests to completion. ``submit`` and ``step`` let a caller feed
    requests as they become known (the rollout worker submits an episode's next turn when its
    observation is back): each ``step`` admits waiting requests into free slots and, in one
    forward, decodes one token of every running row and computes the joining rows' uncached
    tokens (drawing their first); it returns the requests that finished.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        seed: int = 0,
        cache_bytes: int = 0,
        max_num_seqs: int = 64,
        max_kv_bytes: int | None = None,
        onednn_linears: bool = True,
        small_rows_kernel: bool = True,
        decode_attention_kernel: bool = True,
        lean_forward: bool = True,
        memory_pressed: Callable[[], bool] | None = near_kill_threshold,
        max_model_len: int | None = None,
    ):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(seed)
        self.max_positions = min(int(model.config.max_position_embeddings), max_model_len or 2**62)
        self.max_num_seqs = max_num_seqs
        self.max_kv_bytes = max_kv_bytes
        self.peak_kv_bytes = 0  # the most the KV slots held
        self.memory_pressed = memory_pressed
        self.memory_throttles = 0  # admissions held back because the node was near its limit
        self.version = 0
        self.cache = PrefixCache(cache_bytes)
        self.packs_linears = onednn_linears and onednn_available(self.device)
        wanted = self.packs_linears and small_rows_kernel and small_rows_linear.pays_off()
        self.small_rows = small_rows_linear.load_kernel() if wanted else None
        self.linears = self._pack()
        config = model.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.kv = SlotKV(
            config.num_hidden_layers,
            config.num_key_value_heads,
            head_dim,
            model.dtype,
            self.device,
            max_capacity=self.max_positions,
            decode_kernel=self._decode_kernel(decode_attention_kernel),
        )
        self.lean_forward = lean_forward and self.device.type == "cpu"
        self.lean = self._lean()
        self.waiting: deque[_Row] = deque()
        self.running: list[_Row] = []  # row i's KV is in slot i
        self.trace: list[ForwardTrace] | None = None  # a list: every forward is recorded there

    def load_weights(self, version: int, payload: dict[str, torch.Tensor] | LoraPayload) -> None:
        """Switch to policy ``version``: a full state dict, or a LoRA adapter applied to the
        weights the engine started with. The prefix cache starts empty."""
        if self.waiting or self.running:
            raise RuntimeError("load_weights while requests are in flight: finish them first")
        if isinstance(payload, LoraPayload):
            self._load_adapter(payload)
        else:
            self._drop_adapter()
            self.model.load_state_dict(payload)
        self.linears = self._pack()
        self.lean = self._lean()
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

    def _decode_kernel(self, wanted: bool) -> decode_attention.DecodeAttentionKernel | None:
        """The decode attention kernel, where it is wanted and the engine runs on the CPU."""
        return decode_attention.load_kernel() if wanted and self.device.type == "cpu" else None

    def _pack(self) -> OneDNNLinears | None:
        """The model's linear weights as they are now, packed (None: the model's own path)."""
        if not self.packs_linears:
            return None
        return OneDNNLinears(self.model, small_rows=self.small_rows)

    def _lean(self) -> LeanForward | None:
        """The lean forward of the model as it is now (None: the model's own forward)."""
        if not self.lean_forward:
            return None
        return LeanForward.build(self.model, self.linears, self.kv, decoder_ops.load_kernel())

    def forget_prefixes(self) -> None:
        """Empty the prefix cache (the requests in flight keep their own KV)."""
        self.cache.reset(self.version)

    def cache_stats(self) -> EngineCounters:
        """Prefill / cache counters since start, and ``memory_throttles``."""
        return replace(self.cache.stats, memory_throttles=self.memory_throttles)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Continue every request's prefix; results come back in request order."""
        if self.pending():
            raise RuntimeError("generate() with submitted requests in flight: step() them first")
        for i, request in enumerate(requests):
            self.submit(request, tag=("generate", i))
        results: dict[Hashable, GenerationResult] = {}
        while self.pending():
            results.update(self.step())
        return [results[("generate", i)] for i in range(len(requests))]

    def submit(self, request: GenerationRequest, tag: Hashable) -> None:
        """Queue ``request``; ``step`` returns its result under ``tag``."""
        generator = self.generator
        if request.params.seed is not None:
            generator = torch.Generator().manual_seed(request.params.seed)
        self.waiting.append(_Row(request, generator, tag))

    def pending(self) -> int:
        """Requests submitted and not yet returned by ``step``."""
        return len(self.waiting) + len(self.running)

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, GenerationResult]]:
        """Admit waiting requests, then one forward: a token of every running row and the first
        of every joining one; returns the ``(tag, result)`` of every request that finished."""
        decoding = len(self.running)
        refused, distinct = self._admit()
        if self.running:
            self._advance(decoding, distinct)
        return refused + self._retire()

    def _admit(self) -> tuple[list[tuple[Hashable, GenerationResult]], int]:
        """Move as many waiting requests as there are free slots to the running rows (identical
        prefixes then share one computation: the first of each first); returns the requests
        refused at once (a prefix with no room left finishes with "context") and how many of the
        joining rows have distinct prefixes."""
        joining: list[_Row] = []
        refused = []
        limit = self._throttled_limit() if self.waiting else self.max_num_seqs
        while self.waiting and len(self.running) + len(joining) < limit:
            row = self.waiting[0]
            if len(row.request.prefix_ids) >= self.max_positions:
                row.finish_reason = "context"
                refused.append((row.tag, self.waiting.popleft().result()))
            elif self._fits(len(self.running) + len(joining), joining + [row]):
                joining.append(self.waiting.popleft())
            else:
                break
        distinct = len(joining)
        if joining and self.cache.enabled:
            joining, distinct = _distinct_prefixes_first(joining)
        self.running += joining
        return refused, distinct

    def _throttled_limit(self) -> int:
        """Rows the batch may hold now: ``max_num_seqs``; or, with the node near Ray's kill
        threshold, the rows already running (one if none), their slots shrunk to them."""
        if self.memory_pressed is None or not self.memory_pressed():
            return self.max_num_seqs
        if self.memory_throttles == 0:
            logger.warning(
                "node memory near Ray's kill threshold: the engine admits no new rows until it "
                "falls (lower engine.max_kv_bytes, engine.cache_bytes or train.prompts_per_step)"
            )
        self.memory_throttles += 1
        self.kv.shrink(len(self.running))
        return max(1, len(self.running))

    def _capacity(self, rows: list[_Row]) -> int:
        """KV columns the rows' requests can need: prefix + new tokens."""
        longest = max(len(r.request.prefix_ids) + r.request.params.max_new_tokens for r in rows)
        return min(longest, self.max_positions)

    def _fits(self, running: int, joining: list[_Row]) -> bool:
        """Whether slots for ``joining`` beside ``running`` rows (no more: unused ones are freed
        first, ``_reserve``) stay within ``max_kv_bytes`` (always true for the first row: a
        request runs, alone if need be)."""
        if self.max_kv_bytes is None or running + len(joining) == 1:
            return True
        slots = running + len(joining)
        _, capacity = self.kv.grown(slots, self._capacity(joining))
        return self.kv.bytes_for(slots, capacity) <= self.max_kv_bytes

    def _advance(self, decoding: int, distinct: int) -> None:
        """One forward of the running rows: the first ``decoding`` feed their last sampled token;
        each later one joined at this step, its cached prefix KV copied into its slot and the
        rest of its prefix (at least the last token) fed. Only the first ``distinct`` joining
        rows compute: each later one repeats the prefix of one of them
        (``_distinct_prefixes_first``) and copies its KV and logits (G samples of one prompt, or
        n branches of one node, prefill it once). Every row then draws its next token."""
        joining = self.running[decoding:]
        if joining:
            self._reserve(len(self.running), self._capacity(joining))
        computed = joining[:distinct]
        starts = [r.length for r in self.running[:decoding]]
        fed = [[r.token_ids[-1]] for r in self.running[:decoding]]
        for slot, row in enumerate(computed, start=decoding):
            fed.append(self._place_prefix(slot, row))
            starts.append(row.cached)
        logits = self._forward(decoding, fed, torch.tensor(starts))
        for row in self.running[:decoding]:
            row.length += 1
        if joining:
            logits = torch.cat([logits, logits[self._share_prefixes(decoding, distinct)]])
        self._record(self.running, logits)

    def _reserve(self, slots: int, capacity: int) -> None:
        """KV slots for ``slots`` rows of up to ``capacity`` columns; unused slots are freed first
        where keeping them would pass ``max_kv_bytes``."""
        if (
            self.max_kv_bytes is not None
            and self.kv.slots > slots
            and self.kv.bytes_for(*self.kv.grown(slots, capacity)) > self.max_kv_bytes
        ):
            self.kv.shrink(slots)
        self.kv.reserve(slots, capacity)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv.nbytes)

    def _place_prefix(self, slot: int, row: _Row) -> list[int]:
        """Copy the longest cached part of ``row``'s prefix (all but its last token at most)
        into ``slot``; returns the prefix tokens left to feed."""
        prefix = row.request.prefix_ids
        match = self.cache.match(prefix[:-1])
        at = 0
        for piece in match.pieces:
            self.kv.write(slot, at, piece)
            at += piece[0][0].shape[1]
        row.cached, row.length = match.length, len(prefix)
        self.cache.stats.prefill_tokens += len(prefix) - match.length
        self.cache.stats.cached_tokens += match.length
        return list(prefix[match.length :])

    def _share_prefixes(self, decoding: int, distinct: int) -> list[int]:
        """Give each joining row past the first ``distinct`` the KV of the computed row with its
        prefix; returns the slot of that row for each, where their logits are."""
        slot_of = {}
        for slot in range(decoding, decoding + distinct):
            slot_of[self.running[slot].request.prefix_ids] = slot
        sources = []
        for slot in range(decoding + distinct, len(self.running)):
            row = self.running[slot]
            source = slot_of[row.request.prefix_ids]
            original = self.running[source]
            self.kv.move(source, slot, original.length)
            row.cached, row.length = original.cached, original.length
            row.shared = original.length - original.cached
            stats = self.cache.stats  # served whole without computing: a lookup that hit
            stats.lookups, stats.hits = stats.lookups + 1, stats.hits + 1
            stats.cached_tokens += original.length
            sources.append(source)
        return sources

    def _record(self, rows: list[_Row], logits: torch.Tensor) -> None:
        for row, (token, logprob, entropy) in zip(rows, sample_rows(rows, logits), strict=True):
            row.record(token, logprob, entropy, self.max_positions)

    def _retire(self) -> list[tuple[Hashable, GenerationResult]]:
        """Finished rows leave the batch: their KV goes to the prefix cache and the last running
        row moves into the freed slot, so the running rows stay in slots 0..n-1."""
        done = []
        for slot in reversed(range(len(self.running))):
            row = self.running[slot]
            if row.finish_reason is None:
                continue
            self._remember(slot, row)
            last = len(self.running) - 1
            if slot != last:
                self.kv.move(last, slot, self.running[last].length)
                self.running[slot] = self.running[last]
            self.running.pop()
            done.append((row.tag, row.result()))
        return done[::-1]

    def _remember(self, slot: int, row: _Row) -> None:
        """Insert the row's prefix + fed tokens (the KV past its cached part)."""
        if not self.cache.enabled:
            return
        ids = row.request.prefix_ids + tuple(row.token_ids[:-1])
        self.cache.insert(ids, self.kv.read(slot, row.cached, row.length), start=row.cached)

    def _forward(self, decoding: int, fed: list[list[int]], starts: torch.Tensor) -> torch.Tensor:
        """One packed forward of the rows in slots 0..k-1: ``fed[r]`` the tokens the row in slot
        r feeds at columns ``starts[r]..`` (one each for the first ``decoding``). Returns the
        logits (k, V) of each row's last token, float32 on the CPU."""
        start = time.perf_counter()
        counts = torch.tensor([len(ids) for ids in fed])
        input_ids = torch.tensor([token for ids in fed for token in ids])
        if self.lean is not None:  # counts None: a decode step, one token a row
            logits = self.lean.forward(input_ids, starts, None if decoding == len(fed) else counts)
        else:
            logits = self._model_forward(decoding, input_ids, counts, starts)
        if self.trace is not None:
            kind = "decode" if decoding == len(fed) else "mixed" if decoding else "prefill"
            context = int((starts + counts).sum())
            seconds = time.perf_counter() - start
            self.trace.append(ForwardTrace(kind, len(fed), int(counts.sum()), context, seconds))
        return logits

    def _model_forward(
        self, decoding: int, input_ids: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        """``_forward`` through the model's own forward: input_ids (T,) packed, counts (k,) the
        tokens of each row."""
        position_ids, plan = self.kv.begin(starts, counts, decoding)
        last = torch.cumsum(counts, 0) - 1
        linears = OneDNNLinears.active_if(self.linears)
        with attending_through_slots(self.model.config), linears:
            out = self.model(
                input_ids=input_ids[None].to(self.device),
                attention_mask=NO_MASK.to(self.device),
                position_ids=position_ids,
                past_key_values=self.kv,
                use_cache=True,
                logits_to_keep=last.to(self.device),  # the LM head only where a token is drawn
                slot_plan=plan,
            )
        return out.logits[0].float().cpu()
