"""The embedded engine on CUDA gives the CPU engine's greedy tokens (needs a GPU)."""

import pytest
import torch

from treegrpo_ray.actors.engines.hf_engine import HFEngine
from treegrpo_ray.engine import GenerationRequest, SamplingParams
from treegrpo_ray.modeling import load_policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_greedy_tokens_match_between_cpu_and_cuda(tiny_policy):
    cpu_model, tokenizer = load_policy(tiny_policy)
    cuda_model, _ = load_policy(tiny_policy)
    prompt = tokenizer.encode("<question> who is the employer of p3 ? </question>")
    request = GenerationRequest(tuple(prompt), SamplingParams(temperature=0.0, max_new_tokens=8))
    cpu = HFEngine(cpu_model, tokenizer.pad_token_id).generate([request])[0]
    cuda = HFEngine(cuda_model.cuda(), tokenizer.pad_token_id).generate([request])[0]
    assert cuda.token_ids == cpu.token_ids
    torch.testing.assert_close(
        torch.tensor(cuda.logprobs), torch.tensor(cpu.logprobs), atol=1e-4, rtol=0
    )
