"""Data-parallel learner over torch.distributed (gloo): two ranks give the update of one."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.learners.distributed import deal_rows
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.tree import trees_from_arrow


def test_rows_are_dealt_largest_first_to_the_least_loaded_rank():
    # rows of 300, 250, 200, 120, 100 tokens: 300 -> r0, 250 -> r1, 200 -> r1 (250 < 300),
    # 120 -> r0 (300 < 450), 100 -> r0 (420 < 450)
    assert deal_rows([120, 300, 200, 100, 250], 2) == [[0, 1, 3], [2, 4]]
    assert deal_rows([5, 7], 3) == [[1], [0], []]


def _rank_update(rank, world_size, init_file, policy, ppo, trees, out):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        learner = Learner(policy, ppo, temperature=1.0)
        assert (learner.rank, learner.world_size) == (rank, world_size)
        metrics = learner.update(trees)
        params = {k: v.detach().clone() for k, v in learner.model.named_parameters()}
        torch.save({"params": params, "metrics": metrics}, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes, the warm-started policy
def test_two_learner_ranks_give_the_same_update_as_one(tiny_cfg, tiny_policy, tmp_path):
    worker = RolloutWorker(tiny_policy, tiny_cfg.task, tiny_cfg.tree, tiny_cfg.sampling, seed=0)
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()[:4]
    trees = trees_from_arrow(worker.expand(Lease(0, tuple(enumerate(samples)), seed=5)))
    ppo = tiny_cfg.ppo.model_copy(update={"micro_batch_tokens": 400})  # ~one tree per row

    single = Learner(tiny_policy, ppo, temperature=1.0)
    expected = single.update(trees)
    args = (2, tmp_path / "init", tiny_policy, ppo, trees, tmp_path)
    mp.spawn(_rank_update, args=args, nprocs=2, join=True)

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, param in single.model.named_parameters():
        for rank in ranks:  # both ranks took the same step, and it is the single-rank step
            torch.testing.assert_close(rank["params"][name], param.detach(), atol=1e-5, rtol=0)
    for key in ("learner/loss", "learner/kl", "learner/pg_clipfrac", "learner/grad_norm"):
        assert ranks[0]["metrics"][key] == pytest.approx(expected[key], abs=1e-5)
