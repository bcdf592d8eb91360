"""Per-node modifiers and per-depth reward normalisation against hand-computed examples."""

import json
import math

import pytest
import torch

from treegrpo_ray.config import PPOConfig, load_config
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.loss import PPOCoefficients, routed_ppo_loss
from treegrpo_ray.modifiers import (
    DepthDecay,
    DepthRewardNorm,
    NodeModifiers,
    node_modifiers,
    reward_normalizer,
)
from treegrpo_ray.packing import pack_trees
from treegrpo_ray.tree import ROOT, Tree

CLIP = PPOCoefficients(clip_ratio=0.2, dual_clip=3.0, kl_coef=0.5, entropy_coef=0.25, kl_clamp=True)


def _add(tree, parent, action_ids, role, reward=math.nan, obs_ids=()):
    tree.add(
        parent,
        action_ids=action_ids,
        action_logprobs=[-0.5] * len(action_ids),
        obs_ids=list(obs_ids),
        finished=not math.isnan(reward),
        reward=reward,
        role=role,
        policy_version=0,
        tool_call=False,
        finish_reason="stop",
    )


def _batch():
    # prompt [1, 2]; a (search, depth 0, action [3, 4], obs [5]) -> b (answer, depth 1, [6], leaf)
    #                                                          -> d (answer, depth 1, [9], leaf)
    #                c (answer, depth 0, action [7, 8], leaf)
    # layout [1, 2, 3, 4, 5, 6, 7, 8, 9]: nodes a = 0, b = 1, c = 2, d = 3; leaves b, c, d
    tree = Tree(tree_id=0, group_id=0, prompt_ids=[1, 2])
    _add(tree, ROOT, [3, 4], "search", obs_ids=[5])
    _add(tree, 0, [6], "answer", reward=1.0)
    _add(tree, ROOT, [7, 8], "answer", reward=0.2)
    _add(tree, 0, [9], "answer", reward=0.0)
    return pack_trees([tree], micro_batch_tokens=16, pad_token_id=0)


def _loss(batch, routed, entropy, kl_log_ratio=0.0, logprobs=None):
    """Routed loss at ratio 1 (old = current log-probs), ref = logprobs + ``kl_log_ratio``."""
    logprobs = torch.zeros(1, 9) if logprobs is None else logprobs
    denominator = float((batch.loss_mask * routed.weights).sum())
    loss, stats = routed_ppo_loss(
        logprobs,
        logprobs.detach(),
        logprobs.detach() + kl_log_ratio,
        entropy,
        routed,
        batch.loss_mask,
        denominator,
        CLIP,
    )
    return loss, stats, denominator


def test_packing_carries_node_depths_roles_and_leaf_depths():
    batch = _batch()
    assert batch.token_node.tolist() == [[-1, -1, 0, 0, 0, 1, 2, 2, 3]]
    assert batch.node_depths.tolist() == [0, 1, 0, 1]
    assert batch.node_roles == ["search", "answer", "answer", "answer"]
    assert batch.leaf_depths.tolist() == [1, 0, 1]  # leaves b, c, d


def test_depth_decay_is_first_then_per_level_below():
    # the issue's example: 0.92 on the first step, x0.85 per level below
    weights = DepthDecay(first=0.92, per_level=0.85)(torch.tensor([0, 1, 2]))
    torch.testing.assert_close(weights, torch.tensor([0.92, 0.782, 0.6647]))


def test_depth_decay_scales_pg_kl_and_entropy_but_not_the_denominator():
    batch = _batch()
    modifiers = NodeModifiers(kl_coef=0.5, entropy_coef=0.25, depth_decay=DepthDecay(0.5, 0.25))
    routed = batch.route(torch.tensor([1.0, 0.5, -2.0]), "paper", modifiers)
    loss, stats, denominator = _loss(batch, routed, entropy=torch.ones(1, 9))
    # paper routing: a carries +1 and -2 (weight 2), b +1, c +0.5, d -2 (weight 1 each)
    # w(0) = 0.5 (a, c), w(1) = 0.5 * 0.25 = 0.125 (b, d)
    # denominator undecayed: a 2 tokens x 2 + b 1 + c 2 + d 1 = 8
    assert denominator == 8
    # ratio 1, so pg = -s·A per part: a 2 x (-0.5 + 1) = 1, b -0.125, c 2 x -0.25, d +0.25
    #   sum 0.625, / 8 = 0.078125
    # KL 0; entropy 1: s·w·η: a 2 x 0.5·2·0.25 = 0.5, b 0.03125, c 2 x 0.125, d 0.03125
    #   sum 0.8125, / 8 = 0.1015625
    # loss = 0.078125 - 0.1015625 = -0.0234375
    assert loss.item() == pytest.approx(-0.0234375, abs=1e-7)
    assert stats["learner/pg_loss"] == pytest.approx(0.078125, abs=1e-7)
    assert stats["learner/entropy"] == pytest.approx(1.0, abs=1e-7)  # the plain token-mean


def test_per_role_kl_and_entropy_coefficients_replace_the_run_coefficients():
    batch = _batch()
    modifiers = NodeModifiers(
        kl_coef=0.125,
        entropy_coef=0.0625,
        role_kl_coef={"search": 0.5},
        role_entropy_coef={"answer": 0.25},
    )
    routed = batch.route(torch.tensor([1.0, 0.5, -2.0]), "paper", modifiers)
    # every action token: ref - logp = ln 2, so KL = k = 2 - ln 2 - 1 = 1 - ln 2
    loss, stats, denominator = _loss(batch, routed, torch.ones(1, 9), kl_log_ratio=math.log(2))
    k = 1 - math.log(2)
    assert denominator == 8
    # pg (ratio 1): a 2 x (-1 + 2) = 2, b -1, c 2 x -0.5, d +2: sum 2, / 8 = 0.25
    # KL β·w·k: a (search, 0.5) 2 x 0.5·2·k = 2k, b, d (answer, run's 0.125) 0.125k each,
    #   c 2 x 0.125k: sum 2.5k, / 8 = 0.3125k
    # entropy η·w: a (search, run's 0.0625) 2 x 0.0625·2 = 0.25, b 0.25, c 2 x 0.25, d 0.25:
    #   sum 1.25, / 8 = 0.15625
    # loss = 0.25 + 0.3125k - 0.15625 = 0.09375 + 0.3125k
    assert loss.item() == pytest.approx(0.09375 + 0.3125 * k, abs=1e-7)
    assert stats["learner/kl"] == pytest.approx(k, abs=1e-7)


def test_frozen_roles_leave_the_loss_and_the_denominator():
    batch = _batch()
    modifiers = NodeModifiers(kl_coef=0.5, entropy_coef=0.25, frozen_roles=frozenset({"search"}))
    routed = batch.route(torch.tensor([1.0, 0.5, -1.0]), "paper", modifiers)
    entropy = torch.tensor([[0.0, 0.0, 10.0, 10.0, 0.0, 1.0, 2.0, 2.0, 3.0]])
    logprobs = torch.zeros(1, 9, requires_grad=True)
    loss, stats, denominator = _loss(batch, routed, entropy, logprobs=logprobs)
    # a (search) is frozen: only b (1 token), c (2), d (1) count
    assert denominator == 4
    # pg: b -1, c 2 x -0.5, d +1: sum -1, / 4 = -0.25
    # entropy: (1 + 2 + 2 + 3) / 4 = 2, x 0.25 = 0.5; loss = -0.25 - 0.5 = -0.75
    assert loss.item() == pytest.approx(-0.75, abs=1e-7)
    assert stats["learner/entropy"] == pytest.approx(2.0, abs=1e-7)
    loss.backward()
    # d pg / d logp = -A / 4 at ratio 1 (the KL gradient is 0 at ref = logp); a's tokens get none
    expected = torch.tensor([[0, 0, 0, 0, 0, -0.25, -0.125, -0.125, 0.25]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_defaults_leave_the_routed_loss_bit_identical():
    config = PPOConfig()
    assert node_modifiers(config.modifiers, config.kl_coef, config.entropy_coef) is None
    assert reward_normalizer(config.modifiers) is None
    batch = _batch()
    advantages = torch.tensor([1.5, 0.5, -2.0])
    plain = batch.route(advantages, "paper")
    # ratios e^±1.5 make both clips bind
    logprobs = 1.5 * torch.sin(torch.arange(9.0))[None]
    ref = 0.3 * torch.cos(torch.arange(9.0))[None]
    entropy = torch.arange(9.0)[None]

    def loss(routed):
        return routed_ppo_loss(
            logprobs, torch.zeros(1, 9), ref, entropy, routed, batch.loss_mask, 8.0, CLIP
        )

    default_loss, default_stats = loss(batch.route(advantages, "paper", None))
    plain_loss, plain_stats = loss(plain)
    assert torch.equal(default_loss, plain_loss) and default_stats == plain_stats
    # explicit but neutral modifiers: the general formula, equal to float precision
    neutral = NodeModifiers(kl_coef=CLIP.kl_coef, entropy_coef=CLIP.entropy_coef)
    neutral_loss, neutral_stats = loss(batch.route(advantages, "paper", neutral))
    assert neutral_loss.item() == pytest.approx(plain_loss.item(), abs=1e-6)
    assert neutral_stats == pytest.approx(plain_stats, abs=1e-7)


def test_depth_reward_norm_running_statistics_by_hand():
    norm = DepthRewardNorm(momentum=0.5)
    first = norm(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([1, 1, 2]))
    # depth 1: mean 0.5, variance 0.25 (std 0.5) -> ±0.5 / (0.5 + 1e-6); depth 2: one leaf -> 0
    torch.testing.assert_close(first, torch.tensor([0.999998, -0.999998, 0.0]))
    saved = json.loads(json.dumps(norm.state_dict()))
    assert saved == {"depths": [1, 2], "mean": [0.5, 0.5], "var": [0.25, 0.0]}

    second = norm(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1, 1, 2]))
    # depth 1: batch mean 1, var 0: μ = 0.5·0.5 + 0.5·1 = 0.75,
    #   σ² = 0.5·0.25 + 0.5·0 + 0.25·(1 - 0.5)² = 0.1875 -> (1 - 0.75) / sqrt(0.1875) = 1/√3
    # depth 2: batch mean 0, var 0: μ = 0.25, σ² = 0.25·(0 - 0.5)² = 0.0625 -> -0.25 / 0.25 = -1
    third = 1 / math.sqrt(3)
    torch.testing.assert_close(second, torch.tensor([third, third, -1.0]), atol=1e-5, rtol=0)

    resumed = DepthRewardNorm(momentum=0.5)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1, 1, 2])), second)
    assert resumed.state_dict() == norm.state_dict()


def test_depth_reward_norm_ignores_non_finite_rewards_in_its_statistics():
    norm = DepthRewardNorm(momentum=0.5)
    out = norm(torch.tensor([math.nan, 1.0, 3.0]), torch.tensor([0, 0, 0]))
    assert math.isnan(out[0]) and norm.state_dict() == {"depths": [0], "mean": [2.0], "var": [1.0]}


def test_modifiers_config_builds_the_node_modifiers_and_checks_its_values():
    cfg = load_config(
        "tiny-multihop",
        [
            "ppo.modifiers.depth_decay={first: 0.92, per_level: 0.85}",
            "ppo.modifiers.role_kl_coef={search: 0.002, answer: 0.0005}",
            "ppo.modifiers.frozen_roles=[truncated]",
            "ppo.modifiers.reward_norm_momentum=0.9",
        ],
    )
    modifiers = node_modifiers(cfg.ppo.modifiers, cfg.ppo.kl_coef, cfg.ppo.entropy_coef)
    assert modifiers == NodeModifiers(
        kl_coef=cfg.ppo.kl_coef,
        entropy_coef=cfg.ppo.entropy_coef,
        depth_decay=DepthDecay(0.92, 0.85),
        role_kl_coef={"search": 0.002, "answer": 0.0005},
        frozen_roles=frozenset({"truncated"}),
    )
    assert reward_normalizer(cfg.ppo.modifiers).momentum == 0.9
    with pytest.raises(UserInputError, match="ppo.modifiers.depth_decay.per_level"):
        load_config("tiny-multihop", ["ppo.modifiers.depth_decay={first: 1, per_level: 0}"])
    with pytest.raises(UserInputError, match="ppo.modifiers.role_entropy_coef.answer"):
        load_config("tiny-multihop", ["ppo.modifiers.role_entropy_coef={answer: -1}"])


@pytest.mark.slow  # needs actions that search and answer: the warm-started policy
def test_learner_update_with_every_modifier_on(tiny_cfg, tiny_policy):
    from treegrpo_ray.actors.rollout_worker import RolloutWorker
    from treegrpo_ray.actors.schedule import Lease
    from treegrpo_ray.envs.multihop import MultihopTask
    from treegrpo_ray.learners.learner import Learner
    from treegrpo_ray.tree import trees_from_arrow

    modifiers = {
        "depth_decay": {"first": 0.92, "per_level": 0.85},
        "role_kl_coef": {"search": 0.002},
        "role_entropy_coef": {"answer": 0.0005},
        "frozen_roles": ["truncated"],
        "reward_norm_momentum": 0.9,
    }
    ppo = PPOConfig.model_validate({**tiny_cfg.ppo.model_dump(), "modifiers": modifiers})
    learner = Learner(tiny_policy, ppo, temperature=1.0)
    worker = RolloutWorker(tiny_policy, tiny_cfg.task, tiny_cfg.tree, tiny_cfg.sampling, seed=0)
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()[:2]
    trees = trees_from_arrow(worker.expand(Lease(0, tuple(enumerate(samples)), seed=5)))
    metrics = learner.update(trees)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["learner/grad_norm"] > 0
    depths = {leaf.depth for tree in trees for leaf in tree.leaves()}
    assert learner.reward_norm.state_dict()["depths"] == sorted(depths)
