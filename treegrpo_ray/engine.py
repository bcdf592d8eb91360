"""The Engine protocol: what a rollout engine must do (DESIGN §4). No implementation here.

Engines are token-in / token-out: the learner trains on exactly the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from treegrpo_ray.stops import StopStrings


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p < 1 samples from the nucleus; seed makes a call
    reproducible (None: the engine's own generator)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """prefix_ids: the full token prefix to continue (prefix caches match on these token ids, so
    no hint about the tree node is needed). stop: strings that end generation at the token that
    completes one in the decoded text (that token is the last of the output); None: no stop."""

    prefix_ids: tuple[int, ...]
    params: SamplingParams
    stop: StopStrings | None = None


@dataclass
class GenerationResult:
    """token_ids: the new tokens; logprobs: their log-probabilities under the sampling distribution
    (logits / temperature, before top-p truncation; under T = 1 for greedy); finish_reason: ``stop``
    (a stop string ended it), ``length`` (max_new_tokens reached) or ``context`` (the model's context
    is full or the prefix alone exceeds it); prefill_tokens / cached_tokens: prefix tokens computed vs
    served from a cache; entropies: per new token, the entropy (nats) of the distribution it was
    sampled from (after temperature and top-p; 0 for greedy), exact or an engine's documented
    approximation, None when the engine does not report them."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prefill_tokens: int
    cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    entropies: list[float] | None = None


@dataclass
class EngineCounters:
    """An engine's counters since it started (they survive policy versions).

    prefill_tokens / cached_tokens: prefix tokens computed by the model / served from a cache;
    lookups / hits: requests looked up in the prefix cache / served at least one cached token;
    evictions: cache entries dropped for memory; bytes: KV bytes the cache holds now;
    memory_throttles: admissions held back because the node was near its memory limit;
    resumed_segments / resume_prefill_tokens: vLLM's requests resumed after an unconfirmed stop
    string, and the prompt tokens they recomputed. An engine leaves what it cannot see at 0."""

    prefill_tokens: int = 0
    cached_tokens: int = 0
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    bytes: int = 0
    memory_throttles: int = 0
    resumed_segments: int = 0
    resume_prefill_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def since(self, earlier: EngineCounters) -> EngineCounters:
        """What was counted after ``earlier`` (``bytes``: as held now)."""
        counted = {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        return EngineCounters(**{**counted, "bytes": self.bytes})


@dataclass(frozen=True)
class LoraPayload:
    """A LoRA adapter as shipped to rollout engines: the adapter tensors only (peft names, as in
    ``get_peft_model_state_dict``) and the peft ``LoraConfig`` as a dict (``to_dict()``)."""

    adapter_state: dict[str, Any]
    peft_config: dict[str, Any]


class Engine(Protocol):
    """A batched generator with a policy version."""

    version: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Continue every request's prefix; results in request order."""
        ...

    def load_weights(self, version: int, payload: Any) -> None:
        """Switch to policy ``version`` (payload: a full state dict or a ``LoraPayload``); no KV
        computed under an older version may be reused."""
        ...

    def cache_stats(self) -> EngineCounters:
        """A copy of the counters since start."""
        ...

    def forget_prefixes(self) -> None:
        """Drop every cached prefix's KV; the policy and the counters stay."""
        ...


@runtime_checkable
class SteppedEngine(Protocol):
    """An engine fed request by request: ``submit`` queues a request under a tag, each ``step``
    advances the engine and returns the ``(tag, result)`` of the requests it finished (the
    embedded engine: one token of every running request, continuously batched)."""

    def submit(self, request: GenerationRequest, tag: Hashable) -> None: ...

    def step(self) -> list[tuple[Hashable, GenerationResult]]: ...

    def pending(self) -> int: ...


class WaveStepper:
    """``SteppedEngine`` over an engine that generates whole batches (vLLM's offline ``LLM``):
    each ``step`` runs every request submitted since the last one as one ``generate`` call."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queue: list[tuple[Hashable, GenerationRequest]] = []

    def submit(self, request: GenerationRequest, tag: Hashable) -> None:
        self._queue.append((tag, request))

    def pending(self) -> int:
        return len(self._queue)

    def step(self) -> list[tuple[Hashable, GenerationResult]]:
        wave, self._queue = self._queue, []
        results = self.engine.generate([request for _, request in wave])
        return [(tag, result) for (tag, _), result in zip(wave, results, strict=True)]


def stepped(engine: Engine) -> SteppedEngine:
    """``engine`` itself when it can be fed request by request, else a ``WaveStepper`` on it."""
    return engine if isinstance(engine, SteppedEngine) else WaveStepper(engine)
