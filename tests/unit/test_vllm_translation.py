"""The vLLM engine's pure translation layer: our requests -> vLLM sampling arguments, vLLM outputs
-> GenerationResult (stop strings, finish reasons, log-probs, prefill accounting), and the
LoRA adapter files. Runs without vLLM: its outputs are replaced by hand-made test doubles."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from treegrpo_ray.actors.engines.vllm_engine import (
    RequestProgress,
    engine_kwargs,
    generate_in_segments,
    lora_identity,
    sampled_logprobs,
    sampling_kwargs,
    segment_entropies,
    topk_entropy,
    vllm_lora_rank,
    write_peft_adapter,
)
from treegrpo_ray.cluster.engines import tensor_parallel_bundles
from treegrpo_ray.config import EngineConfig, JobConfig, TinyModelConfig, VLLMConfig, load_config
from treegrpo_ray.engine import GenerationRequest, LoraPayload, SamplingParams
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.modeling import build_tiny_model
from treegrpo_ray.stops import StopStrings

# The test doubles' token texts: 7 9 spell the stop string "</s>"; 10 is ">\n", a token that runs
# past the end of the stop string it completes.
TEXT = {1: "a ", 2: "b ", 3: "c ", 4: "d ", 5: "e ", 6: "f ", 7: "</s", 8: "g ", 9: ">", 10: ">\n"}
STOP = StopStrings(("</s>",), lambda ids: "".join(TEXT[i] for i in ids))


@dataclass
class FakeLogprob:
    """Stands in for ``vllm.logprobs.Logprob``."""

    logprob: float


@dataclass
class FakeCompletionOutput:
    """Stands in for ``vllm.outputs.CompletionOutput`` (the fields the engine reads)."""

    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class FakeRequestOutput:
    """Stands in for ``vllm.outputs.RequestOutput``."""

    outputs: list[FakeCompletionOutput]
    num_cached_tokens: int | None = 0


def completion(
    tokens: list[int], logprobs: list[float], finish: str, others: dict[int, float] | None = None
) -> FakeCompletionOutput:
    """A completion whose position i maps tokens[i] to logprobs[i] (plus unrelated entries)."""
    steps = [
        {**{k: FakeLogprob(v) for k, v in (others or {}).items()}, t: FakeLogprob(lp)}
        for t, lp in zip(tokens, logprobs, strict=True)
    ]
    stop_reason = tokens[-1] if finish == "stop" else None
    return FakeCompletionOutput(tokens, steps, finish, stop_reason)


def request(prefix, max_new=8, stop=None, temperature=1.0, top_p=1.0, seed=None):
    params = SamplingParams(temperature, top_p, max_new, seed)
    return GenerationRequest(tuple(prefix), params, stop)


# --- request -> vllm.SamplingParams kwargs -------------------------------------------------------


def test_sampling_kwargs_greedy_ignores_top_p_and_passes_the_stop_strings():
    params = SamplingParams(temperature=0.0, top_p=0.5, max_new_tokens=9, seed=3)
    kwargs = sampling_kwargs(params, StopStrings(("</s>", "!"), str), max_tokens=5)
    assert kwargs == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,  # greedy: no nucleus
        "top_k": 0,
        "min_p": 0.0,
        "seed": 3,
        "max_tokens": 5,  # the segment's budget, not max_new_tokens
        "stop": ["</s>", "!"],
        "include_stop_str_in_output": True,
        "detokenize": True,  # vLLM matches stop strings on the text
        "ignore_eos": True,
        "logprobs": 0,  # only the sampled token's log-prob
    }


def test_sampling_kwargs_sampled_without_stops():
    kwargs = sampling_kwargs(SamplingParams(0.7, 0.9, 16, None), None, max_tokens=16)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["seed"]) == (0.7, 0.9, None)
    assert (kwargs["stop"], kwargs["detokenize"]) == (None, False)
    assert kwargs["logprobs"] == 0


def test_sampling_kwargs_ask_for_the_top_k_log_probs_only_when_sampling():
    sampled = sampling_kwargs(SamplingParams(1.0), None, max_tokens=4, entropy_topk=20)
    greedy = sampling_kwargs(SamplingParams(0.0), None, max_tokens=4, entropy_topk=20)
    assert (sampled["logprobs"], greedy["logprobs"]) == (20, 0)


@pytest.mark.parametrize("temperature", [0.005, 2.5])
def test_sampling_kwargs_refuses_temperatures_vllm_would_change(temperature):
    with pytest.raises(ValueError, match="temperature"):
        sampling_kwargs(SamplingParams(temperature=temperature), (), max_tokens=4)


# --- stop sequences and log-probs ----------------------------------------------------------------


def test_sampled_logprobs_picks_each_sampled_token():
    out = completion([5, 6], [-0.25, -1.5], "length", others={11: -0.1, 12: -0.2})
    assert sampled_logprobs(out.token_ids, out.logprobs) == [-0.25, -1.5]
    with pytest.raises(RuntimeError, match="log-prob"):
        sampled_logprobs([5], None)


def test_topk_entropy_is_a_lower_bound_from_the_top_k():
    top = [math.log(0.5), math.log(0.25)]
    # known 0.5 and 0.25, unknown r = 0.25, p_k = 0.25: 0.5 ln 2 + 0.25 ln 4 + 0.25 ln(1 / 0.25)
    assert topk_entropy(top, k=2) == pytest.approx(1.5 * math.log(2))
    # the exact distribution (0.5, 0.25, 0.125, 0.125) has 1.75 ln 2: short by 0.25 ln 2, the
    # bound r ln((V - n) min(r, p_k) / r) = 0.25 ln(2 x 0.25 / 0.25) (the tail is spread evenly)
    exact = -sum(p * math.log(p) for p in (0.5, 0.25, 0.125, 0.125))
    assert exact - topk_entropy(top, k=2) == pytest.approx(0.25 * math.log(2))
    # known 0.4 and 0.1, r = 0.5 but no unknown token above p_k = 0.1:
    # 0.4 ln 2.5 + 0.1 ln 10 + 0.5 ln 10, exact when the tail is five tokens of 0.1
    tail_at_cap = -sum(p * math.log(p) for p in (0.4, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1))
    assert topk_entropy([math.log(0.4), math.log(0.1)], k=2) == pytest.approx(tail_at_cap)
    # a sampled token outside the top k does not lower the cap: p_k is the k-th largest
    assert topk_entropy([math.log(0.4), math.log(0.1), math.log(0.01)], k=2) == pytest.approx(
        0.4 * math.log(2.5) + 0.1 * math.log(10) + 0.01 * math.log(100) + 0.49 * math.log(10)
    )
    # all the mass known: exact; tokens vLLM masked (top-p) report -inf and count for nothing
    assert topk_entropy([math.log(0.5), math.log(0.5), -math.inf], k=3) == pytest.approx(
        math.log(2)
    )


def test_segment_entropies_zero_for_greedy_none_without_top_k():
    steps = completion([5, 6], [math.log(0.5), math.log(0.5)], "length").logprobs
    assert segment_entropies(SamplingParams(0.0), steps, 20) == [0.0, 0.0]
    assert segment_entropies(SamplingParams(1.0), steps, 0) is None
    # each position knows only its sampled token's 0.5 (p_k = 0.5): 0.5 ln 2 + 0.5 ln 2
    assert segment_entropies(SamplingParams(1.0), steps, 20) == pytest.approx([math.log(2)] * 2)


# --- vLLM segments -> GenerationResult -----------------------------------------------------------


def absorb(progress: RequestProgress, out: FakeCompletionOutput, cached: int | None = 0) -> None:
    tokens = out.token_ids
    progress.absorb(tokens, sampled_logprobs(tokens, out.logprobs), out.finish_reason, cached)


def test_entropies_are_cut_with_the_tokens_and_unknown_once_a_segment_lacks_them():
    p = RequestProgress(request([1], stop=STOP), max_model_len=64)
    p.absorb([4], [-1.0], "stop", 0, [0.5])
    p.absorb([7, 10, 5], [-1.0] * 3, "stop", 1, [0.25, 0.75, 1.0])
    assert (p.token_ids, p.result().entropies) == ([4, 7, 10], [0.5, 0.25, 0.75])
    p = RequestProgress(request([1], stop=STOP), max_model_len=64)
    p.absorb([4], [-1.0], "stop", 0, [0.5])
    p.absorb([7, 9], [-1.0] * 2, "stop", 1, None)
    assert p.result().entropies is None


def test_stop_string_ends_the_request_and_is_kept():
    p = RequestProgress(request([1, 2, 3], stop=STOP), max_model_len=64)
    absorb(p, completion([4, 7, 9], [-1.0, -2.0, -0.5], "stop"), cached=0)
    result = p.result()
    assert (result.token_ids, result.logprobs) == ([4, 7, 9], [-1.0, -2.0, -0.5])
    assert (result.finish_reason, result.prefill_tokens, result.cached_tokens) == ("stop", 3, 0)
    assert result.extra == {}  # one segment


def test_a_token_running_past_the_stop_string_is_kept_whole():
    p = RequestProgress(request([1], stop=STOP), max_model_len=64)
    absorb(p, completion([4, 7, 10], [-1.0, -2.0, -0.5], "stop"))
    assert (p.token_ids, p.finish_reason) == ([4, 7, 10], "stop")


def test_an_unconfirmed_stop_resumes_with_the_tokens_so_far():
    # vLLM reports a stop that the request's own check does not find in "d >".
    p = RequestProgress(request([1, 2, 3], max_new=6, stop=STOP), max_model_len=64)
    absorb(p, completion([4, 9], [-1.0, -2.0], "stop"), cached=0)
    assert p.finish_reason is None
    assert p.prompt_ids() == [1, 2, 3, 4, 9]  # next segment's prompt
    assert p.remaining() == 4  # 6 - 2 tokens already generated
    # Second segment: 2 of its 5 prompt tokens come from the prefix cache.
    absorb(p, completion([7, 9], [-0.5, -0.25], "stop"), cached=2)
    result = p.result()
    assert result.token_ids == [4, 9, 7, 9]
    assert result.logprobs == [-1.0, -2.0, -0.5, -0.25]
    assert result.finish_reason == "stop"
    # The prefix was computed once (3 tokens, no hit); the resume recomputed 5 - 2 = 3 tokens.
    assert (result.prefill_tokens, result.cached_tokens) == (3, 0)
    assert result.extra == {"segments": 2, "resume_prefill_tokens": 3}


def test_tokens_after_a_stop_string_are_cut():
    p = RequestProgress(request([1], stop=STOP), max_model_len=64)
    absorb(p, completion([7, 9, 5], [-1.0, -2.0, -3.0], "length"))
    assert (p.token_ids, p.logprobs, p.finish_reason) == ([7, 9], [-1.0, -2.0], "stop")


def test_length_and_context_finish_reasons():
    p = RequestProgress(request([1, 2], max_new=3), max_model_len=64)
    absorb(p, completion([4, 5, 6], [-1.0] * 3, "length"))
    assert p.finish_reason == "length"
    # 4 prefix + 2 new tokens fill a 6-token context before 10 new tokens are reached.
    p = RequestProgress(request([1, 2, 3, 4], max_new=10), max_model_len=6)
    absorb(p, completion([5, 6], [-1.0] * 2, "length"))
    assert p.finish_reason == "context"
    # A stop string completed by the last allowed token is a stop, not a length finish.
    p = RequestProgress(request([1], max_new=2, stop=STOP), max_model_len=64)
    absorb(p, completion([7, 9], [-1.0] * 2, "stop"))
    assert p.finish_reason == "stop"


def test_prefix_filling_the_context_finishes_before_any_segment():
    p = RequestProgress(request([1, 2, 3, 4]), max_model_len=4)
    result = p.result()
    assert (result.token_ids, result.finish_reason, result.prefill_tokens) == ([], "context", 0)
    with pytest.raises(ValueError, match="prefix"):
        RequestProgress(request([]), max_model_len=4)


def test_vllm_abort_is_an_error():
    p = RequestProgress(request([1]), max_model_len=64)
    with pytest.raises(RuntimeError, match="abort"):
        absorb(p, completion([4], [-1.0], "abort"))


class ScriptedLLM:
    """``run_segments`` double: answers each prompt from a script and records the rounds."""

    def __init__(self, script: dict[tuple[int, ...], tuple[FakeCompletionOutput, int]]):
        self.script = script
        self.rounds: list[list[tuple[tuple[int, ...], int]]] = []

    def __call__(self, progress: Sequence[RequestProgress]) -> list[FakeRequestOutput]:
        self.rounds.append([(tuple(p.prompt_ids()), p.remaining()) for p in progress])
        return [
            FakeRequestOutput([out], cached)
            for out, cached in (self.script[tuple(p.prompt_ids())] for p in progress)
        ]


def test_generate_in_segments_reruns_only_unconfirmed_stops_and_keeps_request_order():
    llm = ScriptedLLM(
        {
            (1, 2): (completion([3, 9], [-0.5, -0.5], "stop"), 0),  # "c >": no "</s>"
            (1, 2, 3, 9): (completion([7, 9], [-1.0, -2.0], "stop"), 2),
            (5,): (completion([7, 9], [-0.1, -0.2], "stop"), 0),
        }
    )
    requests = [
        request([1, 2], max_new=8, stop=STOP),
        request([6] * 10, stop=STOP),  # fills the context: never sent to vLLM
        request([5], max_new=8, stop=STOP),
    ]
    progress = generate_in_segments(requests, max_model_len=10, run_segments=llm)
    assert llm.rounds == [[((1, 2), 8), ((5,), 8)], [((1, 2, 3, 9), 6)]]
    assert [p.segments for p in progress] == [2, 0, 1]
    results = [p.result() for p in progress]
    assert [r.token_ids for r in results] == [[3, 9, 7, 9], [], [7, 9]]
    assert [r.finish_reason for r in results] == ["stop", "context", "stop"]
    assert results[0].logprobs == [-0.5, -0.5, -1.0, -2.0]
    assert [(r.prefill_tokens, r.cached_tokens) for r in results] == [(2, 0), (0, 0), (1, 0)]
    assert results[0].extra == {"segments": 2, "resume_prefill_tokens": 4 - 2}


# --- LoRA -----------------------------------------------------------------------------------------


def test_lora_rank_and_identity():
    assert [vllm_lora_rank(r) for r in (1, 8, 16, 20, 512)] == [1, 8, 16, 32, 512]
    with pytest.raises(ValueError, match="512"):
        vllm_lora_rank(513)
    assert lora_identity(0) == ("policy-v0", 1)
    assert lora_identity(7) == ("policy-v7", 8)


def test_written_adapter_loads_back_into_peft_with_the_same_weights(tmp_path, nonzero_lora_b):
    cfg = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                          intermediate_size=64, max_positions=32)  # fmt: skip
    model = get_peft_model(
        build_tiny_model(cfg, vocab_size=20, seed=0),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    nonzero_lora_b(model, scale=1.0)
    state = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    payload = LoraPayload(state, model.peft_config["default"].to_dict())

    directory = write_peft_adapter(payload, tmp_path / "adapter")

    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    tensors = load_file(directory / "adapter_model.safetensors")
    assert set(tensors) == set(state)
    # the names vLLM parses: base_model.model.<module>.lora_A/B.weight
    assert all(k.startswith("base_model.model.") and k.endswith(".weight") for k in tensors)
    loaded = PeftModel.from_pretrained(build_tiny_model(cfg, vocab_size=20, seed=0), directory)
    reloaded = get_peft_model_state_dict(loaded)
    for name, tensor in state.items():
        torch.testing.assert_close(reloaded[name], tensor, rtol=0, atol=0)


def test_a_single_gpu_engine_is_one_bundle_with_its_gpu():
    bundles = tensor_parallel_bundles(VLLMConfig(device="cuda"), 2, {"rollout_node": 1})
    assert bundles == [{"GPU": 1, "CPU": 2, "rollout_node": 1}]


def test_tensor_parallel_bundle_zero_holds_what_the_actor_asks_for():
    """The actor sits in bundle 0 and asks for the rollout workers' custom resource: a bundle
    without it could never host the actor (the job would wait forever)."""
    bundles = tensor_parallel_bundles(
        VLLMConfig(device="cuda", tensor_parallel_size=3), 2, {"rollout_node": 0.5}
    )
    assert bundles == [{"GPU": 1, "CPU": 2, "rollout_node": 0.5}, {"GPU": 1}, {"GPU": 1}]


def _engine_kwargs(**settings) -> dict:
    return engine_kwargs(VLLMConfig(**settings), seed=3, prefix_cache=True, enable_lora=False)


def test_cpu_engine_settings_default_to_what_the_cpu_build_needs():
    got = _engine_kwargs(device="cpu")
    assert (got["block_size"], got["kv_cache_memory_bytes"]) == (32, 2**30)
    assert got["enable_chunked_prefill"] is False  # a cut prefill crashes seeded CPU requests
    assert got["enforce_eager"] is True
    assert got["dtype"] == "float32"  # the learner's; vLLM's own "auto" picks bfloat16 on CPU
    assert "max_num_batched_tokens" not in got  # vLLM raises it to max_model_len itself
    chosen = _engine_kwargs(device="cpu", block_size=64, kv_cache_gib=0.5, max_num_seqs=8)
    assert (chosen["block_size"], chosen["kv_cache_memory_bytes"]) == (64, 2**29)
    assert chosen["max_num_seqs"] == 8


def test_cuda_engine_settings_leave_vllm_its_defaults():
    got = _engine_kwargs(device="cuda")
    for key in ("block_size", "kv_cache_memory_bytes", "enable_chunked_prefill", "max_num_seqs"):
        assert key not in got
    assert (got["seed"], got["enforce_eager"], got["enable_lora"]) == (3, False, False)
    assert _engine_kwargs(device="cpu", enforce_eager=False)["enforce_eager"] is False
    chosen = _engine_kwargs(device="cuda", block_size=16, enable_chunked_prefill=False)
    assert (chosen["block_size"], chosen["enable_chunked_prefill"]) == (16, False)


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"block_size": 16}, "not a multiple of 32"),
        ({"enable_chunked_prefill": True}, "cannot be true on cpu"),
        ({"tensor_parallel_size": 2}, "must be 1 on cpu"),
    ],
)
def test_settings_the_cpu_build_cannot_run_are_refused(settings, fragment):
    with pytest.raises(ValueError, match=fragment):
        VLLMConfig(device="cpu", **settings)
    VLLMConfig(device="cuda", **settings)  # fine on GPUs


def test_rollout_workers_take_gpus_only_for_vllm_on_cuda():
    cuda = VLLMConfig(device="cuda", tensor_parallel_size=2)
    assert EngineConfig(kind="vllm", vllm=cuda).rollout_gpus() == 2
    assert EngineConfig(kind="vllm", vllm=VLLMConfig(device="cpu")).rollout_gpus() == 0
    assert EngineConfig(kind="hf", vllm=cuda).rollout_gpus() == 0


def test_a_lora_rank_above_the_engines_is_refused():
    overrides = ["engine.kind=vllm", "engine.vllm.device=cpu", "model.lora.rank=32"]
    with pytest.raises(UserInputError, match=r"model.lora.rank \(32\) exceeds"):
        load_config("tiny-multihop-lora", overrides)
    fits = load_config("tiny-multihop-lora", [*overrides, "engine.vllm.max_lora_rank=32"])
    assert isinstance(fits, JobConfig)
