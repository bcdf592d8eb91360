import math

import pytest
import torch

from treegrpo_ray.config import PPOConfig
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
        logprobs,
        old_logprobs,
        ref_logprobs,
        entropy,
        advantages,
        mask,
        PPOCoefficients.of(PPOConfig()),
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


def test_k3_kl_takes_the_reference_codes_clamps_at_their_edges():
    """r = ref - logp: exp(r) - r - 1 below the bound of 10 (r < ~2.61, and r > -20 with the
    log-ratio clamp), 10 and no gradient above it; unclamped it keeps growing (values and
    d/dlogp = 1 - exp(r) by hand)."""
    ref = torch.tensor([1.0, -5.0, 2.6, 2.62, 3.0, 25.0, -25.0], dtype=torch.float64)
    logprobs = torch.zeros_like(ref, requires_grad=True)
    clamped = k3_kl(logprobs, ref)
    clamped.sum().backward()
    want = [0.7182818285, 4.0067379470, 9.8637380350, 10.0, 10.0, 10.0, 10.0]
    torch.testing.assert_close(clamped.detach(), torch.tensor(want, dtype=torch.float64))
    grads = [-1.7182818285, 0.9932620530, -12.4637380350, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(logprobs.grad, torch.tensor(grads, dtype=torch.float64))
    logprobs.grad = None
    free = k3_kl(logprobs, ref, clamp=False)
    free.sum().backward()
    assert free[4].item() == pytest.approx(16.0855369232) and free[5].item() > 7.2e10
    assert logprobs.grad[4].item() == pytest.approx(-19.0855369232)
    assert free[6].item() == pytest.approx(24.0)  # exp(-25) + 25 - 1


def test_the_loss_uses_the_kl_clamp_setting():
    logprobs = torch.zeros(1, 2)
    ref = torch.tensor([[3.0, 0.5]])
    mask = torch.ones(1, 2)
    args = (logprobs, logprobs, ref, torch.zeros(1, 2), torch.zeros(1, 2), mask)
    _, clamped = ppo_loss(*args, PPOCoefficients.of(PPOConfig()))
    _, free = ppo_loss(*args, PPOCoefficients.of(PPOConfig(kl_clamp=False)))
    half = math.exp(0.5) - 1.5
    assert clamped["learner/kl"] == pytest.approx((10.0 + half) / 2)
    assert free["learner/kl"] == pytest.approx((math.exp(3.0) - 4.0 + half) / 2)


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
        PPOCoefficients.of(PPOConfig(kl_coef=0.0, entropy_coef=0.0)),
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
    coef = PPOCoefficients(
        clip_ratio=0.2, dual_clip=3.0, kl_coef=0.0, entropy_coef=0.0, kl_clamp=True
    )
    args = (logprobs, logprobs.detach(), logprobs.detach(), torch.zeros(2), routed)
    loss, _ = routed_ppo_loss(*args, torch.ones(2), 2.0, coef, torch.tensor([0.5, 2.0]))
    # ratio 1 on both tokens: pg = (-1 * 0.5 + 1 * 2.0) / 2 = 0.75
    assert loss.item() == pytest.approx(0.75)
    loss.backward()
    # d/dlogp of -A * w * exp(logp - old) / 2 at ratio 1: -A * w / 2
    assert torch.allclose(logprobs.grad, torch.tensor([-0.25, 1.0]))
