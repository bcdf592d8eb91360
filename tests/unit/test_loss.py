import math

import pytest
import torch

from treegrpo_ray.loss import (
    PPOCoefficients,
    dual_clip_pg_losses,
    k3_kl,
    ppo_loss,
    routed_ppo_loss,
    truncated_is_weights,
)


def test_ppo_loss_matches_hand_computed_value():
    # Five tokens; the last one is masked out (an observation token) and carries absurd values.
    ratios = torch.tensor([[1.5, 0.5, 5.0, 1.1, 100.0]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, 2.0, -50.0]])
    logprobs = torch.log(ratios)
    old_logprobs = torch.zeros_like(logprobs)
    # log(ref / pi) per token: 0, ln 2, -ln 2, 0, (masked)
    ref_logprobs = logprobs + torch.tensor([[0.0, math.log(2), -math.log(2), 0.0, 9.0]])
    entropy = torch.tensor([[1.0, 2.0, 3.0, 2.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # pg per token:
    #  r=1.5, A=+1: max(-1.5, -1.2) = -1.2                (clipped)
    #  r=0.5, A=-1: max(0.5, 0.8) = 0.8; min(0.8, 3) = 0.8 (clipped)
    #  r=5.0, A=-1: max(5.0, 1.2) = 5.0; min(5.0, 3) = 3.0 (dual clip)
    #  r=1.1, A=+2: max(-2.2, -2.2) = -2.2                (not clipped)
    #  token mean = (-1.2 + 0.8 + 3.0 - 2.2) / 4 = 0.1
    # k3 KL = e^x - x - 1: 0, 2 - ln2 - 1 = 0.306853, 0.5 + ln2 - 1 = 0.193147, 0 -> mean 0.125
    # entropy mean = (1 + 2 + 3 + 2) / 4 = 2
    # loss = 0.1 + 0.001 * 0.125 - 0.001 * 2 = 0.098125
    loss, stats = ppo_loss(
        logprobs, old_logprobs, ref_logprobs, entropy, advantages, mask, PPOCoefficients()
    )
    assert loss.item() == pytest.approx(0.098125, abs=1e-6)
    assert stats["learner/pg_loss"] == pytest.approx(0.1, abs=1e-6)
    assert stats["learner/kl"] == pytest.approx(0.125, abs=1e-6)
    assert stats["learner/entropy"] == pytest.approx(2.0, abs=1e-6)
    assert stats["learner/pg_clipfrac"] == pytest.approx(0.75)


def test_dual_clip_bounds_only_negative_advantages():
    ratio = torch.tensor([10.0, 10.0])
    advantages = torch.tensor([-1.0, 1.0])
    losses, _ = dual_clip_pg_losses(torch.log(ratio), torch.zeros(2), advantages, 0.2, 3.0)
    # A=-1: max(10, 1.2) = 10 -> dual clip 3; A=+1: max(-10, -1.2) = -1.2
    torch.testing.assert_close(losses, torch.tensor([3.0, -1.2]))


def test_k3_kl_is_zero_at_equal_policies_and_positive_elsewhere():
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.equal(k3_kl(logprobs, logprobs), torch.zeros(3))
    assert bool((k3_kl(logprobs, logprobs + 0.3) > 0).all())


def test_gradient_flows_only_through_masked_tokens():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, _ = ppo_loss(
        logprobs,
        torch.zeros(1, 3),
        torch.zeros(1, 3),
        torch.zeros(1, 3),
        torch.ones(1, 3),
        mask,
        PPOCoefficients(kl_coef=0.0, entropy_coef=0.0),
    )
    loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A = -1, divided by 2 masked tokens
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, 0.0, -0.5]]))


def test_truncated_is_weights_by_hand():
    proximal = torch.tensor([-1.0, -1.0, -2.0, -0.5])
    behaviour = torch.tensor([-1.5, -0.5, -2.0, -2.0])
    stale = torch.tensor([True, True, True, False])
    weights = truncated_is_weights(proximal, behaviour, stale, cap=1.5)
    # exp(0.5) = 1.6487 -> capped 1.5; exp(-0.5) = 0.6065; exp(0) = 1; not stale -> 1
    assert torch.allclose(weights, torch.tensor([1.5, math.exp(-0.5), 1.0, 1.0]))


def test_is_weights_scale_the_policy_gradient_term_only():
    from treegrpo_ray.advantage import RoutedAdvantages

    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    routed = RoutedAdvantages(
        advantages=torch.tensor([[1.0, -1.0]]),
        leaves=torch.ones(1, 2),
        weights=torch.ones(2),
    )
    coef = PPOCoefficients(clip_ratio=0.2, dual_clip=3.0, kl_coef=0.0, entropy_coef=0.0)
    args = (logprobs, logprobs.detach(), logprobs.detach(), torch.zeros(2), routed)
    loss, _ = routed_ppo_loss(*args, torch.ones(2), 2.0, coef, torch.tensor([0.5, 2.0]))
    # ratio 1 on both tokens: pg = (-1 * 0.5 + 1 * 2.0) / 2 = 0.75
    assert loss.item() == pytest.approx(0.75)
    loss.backward()
    # d/dlogp of -A * w * exp(logp - old) / 2 at ratio 1: -A * w / 2
    assert torch.allclose(logprobs.grad, torch.tensor([-0.25, 1.0]))
