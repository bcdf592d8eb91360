"""The embedded engine's per-token entropies against an independent computation from the model's
logits: the entropy of the distribution each token was drawn from, after temperature and top-p."""

from __future__ import annotations

import pytest
import torch

from treegrpo_ray.actors.engines.hf_engine import HFEngine, _Row, sample_rows
from treegrpo_ray.config import TinyModelConfig
from treegrpo_ray.engine import GenerationRequest, SamplingParams
from treegrpo_ray.modeling import build_tiny_model

VOCAB = 40


def reference_entropies(
    model, prefix: list[int], tokens: list[int], temperature: float, top_p: float
):
    """Per generated position, in float64 from one uncached forward pass: p = softmax(logits / T),
    kept on the smallest set of most likely tokens whose mass reaches top_p, renormalised;
    entropy -sum p ln p."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prefix + tokens])).logits[0].double()
    out = []
    for row in logits[len(prefix) - 1 : -1]:
        probs, _ = torch.sort(torch.softmax(row / temperature, dim=-1), descending=True)
        keep = min(int((torch.cumsum(probs, 0) < top_p).sum()) + 1, len(probs))
        nucleus = probs[:keep] / probs[:keep].sum()
        out.append(float(-(nucleus * nucleus.log()).sum()))
    return out


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.3, 0.5)])
def test_entropies_are_those_of_the_sampling_distribution(temperature, top_p):
    model = build_tiny_model(TinyModelConfig(num_layers=1), vocab_size=VOCAB, seed=0).eval()
    engine = HFEngine(model, pad_token_id=0, seed=0, cache_bytes=2**20)
    prefixes = [[3, 4, 5, 6], [7, 8], [3, 4, 5, 6, 9]]  # the third partly from the prefix cache
    for _ in range(2):
        requests = [
            GenerationRequest(tuple(p), SamplingParams(temperature, top_p, 6, seed=i))
            for i, p in enumerate(prefixes)
        ]
        for prefix, result in zip(prefixes, engine.generate(requests), strict=True):
            expected = reference_entropies(model, prefix, result.token_ids, temperature, top_p)
            assert len(result.entropies) == len(result.token_ids) == 6
            torch.testing.assert_close(
                torch.tensor(result.entropies, dtype=torch.float64),
                torch.tensor(expected, dtype=torch.float64),
                atol=1e-5,
                rtol=0,
            )


def test_greedy_tokens_have_entropy_zero_and_a_full_context_none_to_report():
    model = build_tiny_model(TinyModelConfig(num_layers=1, max_positions=16), VOCAB, seed=0)
    engine = HFEngine(model.eval(), pad_token_id=0)
    greedy, full = engine.generate(
        [
            GenerationRequest((3, 4), SamplingParams(temperature=0.0, max_new_tokens=4)),
            GenerationRequest(tuple(range(16)), SamplingParams(max_new_tokens=4)),
        ]
    )
    assert greedy.entropies == [0.0] * 4
    assert (full.finish_reason, full.entropies) == ("context", [])


def test_a_row_with_impossible_tokens_draws_beside_a_greedy_row_with_exact_entropies():
    """-inf logits (tokens ruled out) have probability 0 and add nothing to the entropy; a greedy
    row in the same batch takes its argmax and reports entropy 0."""
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")], [0.5, 2.0, 0.0, 1.0]])
    rows = [
        _Row(GenerationRequest((1,), SamplingParams(seed=3)), torch.Generator().manual_seed(3), 0),
        _Row(GenerationRequest((1,), SamplingParams(temperature=0.0)), torch.Generator(), 1),
    ]
    (token, logprob, entropy), greedy = sample_rows(rows, logits)
    p = torch.softmax(torch.tensor([0.0, 1.0], dtype=torch.float64), 0)
    assert token in (0, 2)
    assert logprob == pytest.approx(float(p[token // 2].log()), abs=1e-6)
    assert entropy == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)
    assert greedy == (1, pytest.approx(float(torch.log_softmax(logits[1], 0)[1])), 0.0)
