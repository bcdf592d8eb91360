"""End to end through the real Ray pipeline: local Ray, rollout actor, queue, Ray Train learner."""

import json

import pytest
import torch
from safetensors.torch import load_file

from cluster.train import train

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("learners", [1, 2], ids=["1-learner", "2-learners"])
def test_two_updates_change_every_parameter_and_reach_the_workers(make_cfg, tiny_policy, learners):
    cfg = make_cfg(
        f"name=e2e-{learners}",
        f"cluster.learner_workers={learners}",
        f"cluster.torch_threads={3 - learners}",  # one thread per core
        "train.steps=2",
        "train.prompts_per_step=4",
        "train.eval_every=1",
        "train.eval_questions=16",
        "train.final_eval_questions=16",
        "train.checkpoint_every=1",
    )
    summary = train(cfg, progress=False)

    assert summary["rollout/worker_versions"] == [2]
    assert summary["steps"] == 2
    before = load_file(f"{tiny_policy}/model.safetensors")
    after = load_file(str(cfg.run_dir / "checkpoint-final" / "model.safetensors"))
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == []

    records = [
        json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["learner/policy_version"] == record["step"]
        assert record["tree/groups"] == 4
        assert record["tree/leaves"] == 4 * cfg.tree.shape().leaves_per_prompt
        assert "eval/greedy_em" in record and "budget/generated_tokens" in record
        assert 0.0 <= record["rollout/cache_hit_rate"] < 1.0
    for key in ("before/eval/sampled_em", "after/eval/sampled_em", "after/eval/greedy_em"):
        assert 0.0 <= summary[key] <= 1.0
    assert "held-out EM" in summary["line"]
    assert any((cfg.run_dir / "tensorboard").iterdir())
    checkpoints = cfg.run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000001", "step-000002"]
