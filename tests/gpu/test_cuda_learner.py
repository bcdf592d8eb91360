"""The learner on a GPU: one update on CUDA against the same update on the CPU (needs CUDA)."""

import pytest
import torch

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.tree import trees_from_arrow

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _trees(cfg, policy, prompts):
    worker = RolloutWorker(policy, cfg.task, cfg.tree, cfg.sampling, seed=0)
    samples = MultihopTask(cfg.task.multihop).train_samples()[:prompts]
    return trees_from_arrow(worker.expand(Lease(0, tuple(enumerate(samples)), seed=5)))


def _update(tiny_cfg, tiny_policy, trees, device, precision):
    ppo = tiny_cfg.ppo.model_copy(update={"precision": precision})
    learner = Learner(tiny_policy, ppo, temperature=1.0, device=device)
    metrics = learner.update(trees)
    grads = torch.cat([p.grad.flatten().cpu() for p in learner.model.parameters()])
    return learner, metrics, grads


@pytest.mark.parametrize("precision", ["float32", "bfloat16-mixed"])
def test_an_update_on_cuda_matches_the_float32_update_on_the_cpu(tiny_cfg, tiny_policy, precision):
    trees = _trees(tiny_cfg, tiny_policy, prompts=4)
    _, want, want_grads = _update(tiny_cfg, tiny_policy, trees, "cpu", "float32")
    learner, got, got_grads = _update(tiny_cfg, tiny_policy, trees, "cuda", precision)
    # model, reference and optimizer state all live on the GPU
    assert {p.device.type for p in learner.model.parameters()} == {"cuda"}
    assert {p.device.type for p in learner.ref_model.parameters()} == {"cuda"}
    assert {s["exp_avg"].device.type for s in learner.optimizer.state.values()} == {"cuda"}
    tolerance = 1e-4 if precision == "float32" else 0.02
    assert got["learner/loss"] == pytest.approx(want["learner/loss"], abs=tolerance)
    cosine = torch.nn.functional.cosine_similarity(got_grads, want_grads, dim=0)
    assert cosine > (0.9999 if precision == "float32" else 0.95)
    # what rollout engines load comes back to the CPU
    assert {t.device.type for t in learner.policy_state().values()} == {"cpu"}
