"""The real-model benchmark's FLOP count of the learner's passes
(``benchmarks/realmodel_loop.learner_rates``), against hand-computed numbers."""

from __future__ import annotations

import pytest

from benchmarks.realmodel_loop import learner_rates

# 100 non-embedding parameters, an LM head of 10, 8 FLOPs per visible (query, key) pair
SIZES = {"body_params": 100, "head_params": 10, "attention_pair_flops": 8}
ONE_FLOP_A_SECOND = {"matmul_gflop_s": 1e-9}


def _update(adapter_params: int) -> dict[str, float]:
    """One update's metrics: 5 unique tokens, 2 action tokens, 7 visible pairs, 1 s a pass."""
    return {
        "learner/tokens": 5,
        "actions": 2,
        "attention_pairs": 7,
        "adapter_params": adapter_params,
        "timing/ref_logprobs": 1.0,
        "timing/optimize": 1.0,
    }


def test_lora_counts_the_frozen_linears_twice_and_the_adapter_and_attention_three_times():
    rates = learner_rates([_update(adapter_params=3)], SIZES, ONE_FLOP_A_SECOND, reference=True)
    # a forward: linears 2 x 100 x 5 + 2 x 10 x 2 = 1040, adapter 2 x 3 x 5 = 30, attention 8 x 7
    assert rates["train_matmul_ratio"] == pytest.approx(2 * 1040 + 3 * (30 + 56))
    assert rates["train_linears_ratio"] == pytest.approx(2 * 1040)
    # the reference is the adapter disabled
    assert rates["reference_matmul_ratio"] == pytest.approx(1040 + 56)
    assert rates["attention_share_of_forward"] == pytest.approx(56 / (1040 + 30 + 56))


def test_full_fine_tuning_counts_every_matmul_three_times_and_no_reference_without_one():
    rates = learner_rates([_update(adapter_params=0)], SIZES, ONE_FLOP_A_SECOND, reference=False)
    assert rates["train_matmul_ratio"] == pytest.approx(3 * (1040 + 56))
    assert rates["train_linears_ratio"] == pytest.approx(3 * 1040)
    assert "reference_matmul_ratio" not in rates
