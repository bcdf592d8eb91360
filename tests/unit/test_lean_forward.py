"""The engine's lean forward: the tokens and log-probs of the model's own forward, at decode,
mixed and prefill steps, for Llama and Qwen2 models (biases included) and after a LoRA adapter
is merged; models it cannot run keep the model's forward."""

import pytest
import torch
import transformers

from treegrpo_ray.actors.engines.hf_engine import HFEngine
from treegrpo_ray.config import TinyModelConfig
from treegrpo_ray.engine import GenerationRequest, LoraPayload, SamplingParams
from treegrpo_ray.kernels import decode_attention, decoder_ops
from treegrpo_ray.modeling import build_tiny_model

VOCAB = 48
pytestmark = pytest.mark.skipif(
    decoder_ops.load_kernel() is None or decode_attention.load_kernel() is None,
    reason="no AVX2 or no C compiler here",
)


def _llama() -> transformers.LlamaForCausalLM:
    """A tiny Llama with biases on its attention and MLP layers (SmolLM2's has none)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _qwen2() -> transformers.Qwen2ForCausalLM:
    return build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=0).eval()


def _requests() -> list[GenerationRequest]:
    """Prefixes and actions of different lengths (rows finish apart, so others join the running
    ones), sampled with their own seeds, and one greedy request."""
    sampled = [
        GenerationRequest(tuple(range(3, 3 + n)), SamplingParams(1.0, 1.0, new, seed=i))
        for i, (n, new) in enumerate([(5, 10), (11, 4), (2, 7), (8, 10)])
    ]
    return sampled + [GenerationRequest((7, 8, 9), SamplingParams(0.0, 1.0, 10))]


def _lean_steps(engine: HFEngine) -> list[int]:
    """Counts the lean forwards ``engine`` runs from now on (a spy on its forward)."""
    assert engine.lean is not None
    calls, forward = [], engine.lean.forward
    engine.lean.forward = lambda *args: calls.append(1) or forward(*args)  # type: ignore[method-assign]
    return calls


def _assert_same_generations(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_lean_forwards_give_the_models_own_tokens_and_logprobs(build):
    model = build()
    lean = HFEngine(model, pad_token_id=0, max_num_seqs=3, memory_pressed=None)
    steps, lean.trace = _lean_steps(lean), []
    got = lean.generate(_requests())
    reference = HFEngine(model, 0, max_num_seqs=3, lean_forward=False, memory_pressed=None)
    assert reference.lean is None
    _assert_same_generations(got, reference.generate(_requests()))
    # every forward went through it: the first prefill, rows joining the others, decode steps
    assert {t.kind for t in lean.trace} == {"prefill", "mixed", "decode"}
    assert len(steps) == len(lean.trace)


def test_the_lean_forward_follows_a_merged_lora_adapter(nonzero_lora_b):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(_llama(), config)
    nonzero_lora_b(peft_model, scale=0.3, seed=1)
    adapter = LoraPayload(get_peft_model_state_dict(peft_model), config.to_dict())
    lean, reference = (
        HFEngine(_llama(), 0, lean_forward=flag, memory_pressed=None) for flag in (True, False)
    )
    before = lean.generate(_requests())
    for engine in (lean, reference):
        engine.load_weights(1, adapter)
    steps = _lean_steps(lean)
    after = lean.generate(_requests())
    _assert_same_generations(after, reference.generate(_requests()))
    assert steps and [r.token_ids for r in after] != [r.token_ids for r in before]


def test_a_model_the_lean_forward_cannot_run_keeps_its_own_forward():
    model = _qwen2()
    model.config.hidden_act = "gelu"  # its MLP is not SiLU(gate) * up
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    engine = HFEngine(model, pad_token_id=0, memory_pressed=None)
    assert engine.lean is None
    assert len(engine.generate(_requests())[0].token_ids) == 10  # its max_new_tokens
