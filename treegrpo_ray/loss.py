"""PPO policy loss with dual clip, k3 KL to the reference policy and an entropy bonus.

Every tensor below is (B, T) over token positions; ``loss_mask`` is 1 on action tokens and 0 on
prompt, observation and padding tokens, so observation tokens never enter the loss. Aggregation is
token-mean: the sum over all masked tokens of the batch divided by their count.

``ppo_loss`` is the loss of the path-expanded batch (one row per leaf, the reference layout);
``routed_ppo_loss`` is the same loss on packed trees with advantages routed to nodes
(``advantage.route_to_nodes``), each unique token forwarded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treegrpo_ray.advantage import RoutedAdvantages
from treegrpo_ray.config import PPOConfig


@dataclass(frozen=True)
class PPOCoefficients:
    """clip_ratio: ε of the clipped ratio; dual_clip: c of the dual clip (lower bound of the loss
    for negative advantages, c > 1); kl_coef: weight of the k3 KL to the reference; entropy_coef:
    weight of the entropy bonus; kl_clamp: the k3 estimate with the reference code's clamps
    (``k3_kl``)."""

    clip_ratio: float
    dual_clip: float
    kl_coef: float
    entropy_coef: float
    kl_clamp: bool

    @classmethod
    def of(cls, ppo: PPOConfig) -> PPOCoefficients:
        """The coefficients of ``ppo`` (its defaults: ``PPOCoefficients.of(PPOConfig())``)."""
        return cls(ppo.clip_ratio, ppo.dual_clip, ppo.kl_coef, ppo.entropy_coef, ppo.kl_clamp)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean of ``values`` over ``mask`` (both (B, T)); 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


KL_LOG_RATIO_BOUND, KL_BOUND = 20.0, 10.0  # the Tree-GRPO code's low_var_kl clamps


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """Schulman's low-variance estimator of KL(π || π_ref): exp(r) - r - 1 with r = ref - logp.

    ``clamp``: as the reference code's ``low_var_kl``, r clamped to [-20, 20] and the estimate to
    [-10, 10], so a token whose probability fell far below the reference's (r above ~2.61) adds
    at most 10 and no gradient; unclamped, it grows as exp(r), and so does its gradient. Any
    shape; elementwise."""
    log_ratio = ref_logprobs - logprobs
    if clamp:
        log_ratio = log_ratio.clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    kl = torch.exp(log_ratio) - log_ratio - 1
    return kl.clamp(-KL_BOUND, KL_BOUND) if clamp else kl


def dual_clip_pg_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float,
    dual_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped policy-gradient loss and a 0/1 tensor of where clipping bound it.

    ``max(-A·ρ, -A·clip(ρ, 1±ε))``, and for A < 0 additionally ``min(·, -A·c)`` (dual clip).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    pg = torch.maximum(unclipped, clipped)
    dual = torch.minimum(pg, -advantages * dual_clip)
    losses = torch.where(advantages < 0, dual, pg)
    was_clipped = (clipped > unclipped) | ((advantages < 0) & (dual < pg))
    return losses, was_clipped.float()


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: PPOCoefficients,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO loss ``pg + kl_coef·KL - entropy_coef·H`` and its parts (for metrics).

    All inputs are (B, T); ``advantages`` is the leaf advantage broadcast over its tokens.
    Returns the scalar loss and ``learner/...`` statistics.
    """
    pg, clipped = dual_clip_pg_losses(
        logprobs, old_logprobs, advantages, coef.clip_ratio, coef.dual_clip
    )
    kl = k3_kl(logprobs, ref_logprobs, coef.kl_clamp)
    pg_loss = masked_mean(pg, loss_mask)
    kl_loss = masked_mean(kl, loss_mask)
    entropy_mean = masked_mean(entropy, loss_mask)
    loss = pg_loss + coef.kl_coef * kl_loss - coef.entropy_coef * entropy_mean
    stats = {
        "learner/pg_loss": pg_loss.item(),
        "learner/kl": kl_loss.item(),
        "learner/entropy": entropy_mean.item(),
        "learner/pg_clipfrac": masked_mean(clipped, loss_mask).item(),
        "learner/approx_kl_old": masked_mean(old_logprobs - logprobs, loss_mask).item(),
    }
    return loss, stats


def routed_ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor,
    routed: RoutedAdvantages,
    loss_mask: torch.Tensor,
    denominator: float,
    coef: PPOCoefficients,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``pg + kl_coef·KL - entropy_coef·H`` of packed tokens, summed and divided by
    ``denominator``, and its parts (for metrics).

    ``is_weights`` (same shape as ``logprobs``, no gradient): per-token importance weights that
    multiply the pg term, the truncated off-policy correction for tokens sampled by an older
    policy (``truncated_is_weights``); None means 1 everywhere.

    logprobs, old_logprobs, ref_logprobs, entropy, loss_mask: one packed row (T,) or rows (R, T);
    ``routed`` holds the routing of the same tokens (advantages and leaves (K, ...), weights
    (...), see ``PackedBatch.route``). A token's pg term is the sum over its
    advantage parts, its KL and entropy terms count ``routed.weights`` times. ``denominator`` is
    ``sum(loss_mask * routed.weights)`` over the whole batch, so that the losses (and the
    statistics) of its micro-batches add up to the full-batch token-mean; in ``paper`` mode that is
    the path-expanded action-token count and the result equals ``ppo_loss`` on the expanded paths.

    Where ``routed`` carries per-token ``kl_coef`` and ``entropy_coef`` (per-node modifiers,
    ``treegrpo_ray.modifiers``), they replace ``coef.kl_coef`` and ``coef.entropy_coef``: the loss
    is ``pg + sum(loss_mask·weights·(kl_coef·KL - entropy_coef·H)) / denominator``. The
    ``learner/kl`` and ``learner/entropy`` statistics stay the plain token-means, undecayed.
    ``ref_logprobs`` None (every KL coefficient 0, no reference pass): no KL term and no
    ``learner/kl`` statistic; the loss and its gradients are those of any reference at weight 0.
    """
    pg, clipped = dual_clip_pg_losses(
        logprobs, old_logprobs, routed.advantages, coef.clip_ratio, coef.dual_clip
    )

    def total(values: torch.Tensor) -> torch.Tensor:
        return (values * loss_mask).sum() / denominator

    pg_tokens = pg.sum(0) if is_weights is None else pg.sum(0) * is_weights
    pg_loss = total(pg_tokens)
    kl = (
        torch.zeros_like(logprobs)
        if ref_logprobs is None
        else k3_kl(logprobs, ref_logprobs, coef.kl_clamp)
    )
    kl_loss = total(kl * routed.weights)
    entropy_mean = total(entropy * routed.weights)
    if routed.kl_coef is None or routed.entropy_coef is None:
        loss = pg_loss + coef.kl_coef * kl_loss - coef.entropy_coef * entropy_mean
    else:
        regularizer = routed.kl_coef * kl - routed.entropy_coef * entropy
        loss = pg_loss + total(regularizer * routed.weights)
    stats = {
        "learner/pg_loss": pg_loss.item(),
        "learner/entropy": entropy_mean.item(),
        "learner/pg_clipfrac": total((clipped * routed.leaves).sum(0)).item(),
        "learner/approx_kl_old": total((old_logprobs - logprobs) * routed.weights).item(),
    }
    if ref_logprobs is not None:
        stats["learner/kl"] = kl_loss.item()
    return loss, stats


def truncated_is_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    stale: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """``min(π_prox(a)/μ(a), cap)`` on ``stale`` tokens (sampled by an older policy μ), 1 on the
    others; all inputs of one shape, the log-probs detached. With the current policy as π_prox
    this is decoupled PPO's behaviour correction, truncated as in IMPALA / V-trace."""
    ratio = torch.exp(proximal_logprobs - behaviour_logprobs).clamp(max=cap)
    return torch.where(stale, ratio, torch.ones_like(ratio))
