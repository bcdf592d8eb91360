"""Learner checkpoints: a restored learner continues exactly; a crash mid-write loses nothing."""

import pytest
import torch

import treegrpo_ray.learners.checkpoint as checkpoint
from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.tree import trees_from_arrow


@pytest.fixture(scope="module")
def batches(tiny_cfg, tiny_policy):
    """Two batches of trees (2 prompt groups each)."""
    worker = RolloutWorker(tiny_policy, tiny_cfg.task, tiny_cfg.tree, tiny_cfg.sampling, seed=0)
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()
    return [
        trees_from_arrow(worker.expand(Lease(i, tuple(enumerate(samples[2 * i : 2 * i + 2])), i)))
        for i in range(2)
    ]


def test_a_restored_learner_takes_exactly_the_next_step(tiny_cfg, tiny_policy, batches, tmp_path):
    # shuffled minibatches over two epochs: the next step depends on the restored Python RNG
    ppo = tiny_cfg.ppo.model_copy(update={"epochs": 2, "minibatches": 2})
    running = Learner(tiny_policy, ppo, temperature=1.0, seed=3)
    running.update(batches[0])
    path = checkpoint.save_checkpoint(running.state_dict(), tmp_path, extra={"next_group": 2})
    expected = running.update(batches[1])

    resumed = Learner(tiny_policy, ppo, temperature=1.0, seed=99)
    state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path))
    resumed.load_state_dict(state)
    assert path.name == "step-000001" and state.counters["next_group"] == 2
    assert resumed.version == 1
    got = resumed.update(batches[1])
    unrepeatable = ("timing/", "learner/peak_rss_bytes")  # wall times; the process's memory
    assert {k: v for k, v in got.items() if not k.startswith(unrepeatable)} == {
        k: v for k, v in expected.items() if not k.startswith(unrepeatable)
    }
    for (name, param), other in zip(
        running.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(param, other), name


def test_a_crash_while_writing_keeps_the_previous_checkpoint(
    tiny_cfg, tiny_policy, batches, tmp_path, monkeypatch
):
    learner = Learner(tiny_policy, tiny_cfg.ppo, temperature=1.0)
    first = checkpoint.save_checkpoint(learner.state_dict(), tmp_path)
    learner.update(batches[0])

    def crash(state, directory, extra):
        (directory / "model.safetensors").write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_state", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(learner.state_dict(), tmp_path)
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000"]
    restored = Learner(tiny_policy, tiny_cfg.ppo, temperature=1.0)
    restored.load_state_dict(checkpoint.load_checkpoint(first))
    assert restored.version == 0


def test_only_the_newest_checkpoints_are_kept(tiny_cfg, tiny_policy, tmp_path):
    learner = Learner(tiny_policy, tiny_cfg.ppo, temperature=1.0)
    for version in range(4):
        learner.version = version
        checkpoint.save_checkpoint(learner.state_dict(), tmp_path)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000002", "step-000003"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-000003"
