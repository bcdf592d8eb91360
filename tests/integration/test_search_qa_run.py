"""search_qa end to end on the built-in fixture: a job whose rollout workers search through the
job's retriever actor, and the in-process loop (in-process retriever) taking the same step."""

import json

import pytest
import torch

from treegrpo_ray.cluster.local_run import LocalRun
from treegrpo_ray.cluster.train import train
from treegrpo_ray.config import TinyModelConfig, load_config
from treegrpo_ray.envs.qa_fixture import build_fixture
from treegrpo_ray.modeling import build_tiny_model, build_word_tokenizer

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def uniform_policy(tmp_path_factory):
    """A tiny Hugging Face policy directory whose next-token distribution is uniform over a few
    words: the search_qa tags and the fixture's first answers (every other word reads as <unk>).
    Zero embeddings (tied with the output layer) make every logit 0, so sampled actions search
    and answer often enough to exercise the retriever."""
    path = tmp_path_factory.mktemp("uniform-policy")
    answers = [s.answers[0] for s in build_fixture(0).train[:3]]
    words = ["<search>", "</search>", "<answer>", "</answer>", *answers]
    tokenizer = build_word_tokenizer(words, path)
    model = build_tiny_model(TinyModelConfig(max_positions=1024), len(tokenizer), seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.zero_()
    model.save_pretrained(str(path))
    return str(path)


def _cfg(policy, out):
    return load_config(
        "tiny-multihop",
        [
            "name=search-qa",
            "task.name=search_qa",
            "task.search_qa.fixture=true",
            "task.search_qa.top_k=1",
            "task.search_qa.max_turns=3",
            f"model.path={policy}",
            "tree.m=2",
            "tree.n=1",
            "train.steps=1",
            # ~6 searches expected from the uniform policy at this size (2 at 4 prompts and
            # 8-token actions, too few to count on for any seed)
            "train.prompts_per_step=8",
            "sampling.max_action_tokens=16",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.final_eval_questions=8",
            f"train.output_dir={out}",
            "ppo.micro_batch_tokens=8192",
            "cluster.retriever_cpus=0.5",
        ],
    )


def test_a_search_qa_job_searches_through_its_retriever_actor(uniform_policy, tmp_path):
    cfg = _cfg(uniform_policy, tmp_path)
    summary = train(cfg, progress=False)
    assert summary["steps"] == 1
    record = json.loads((cfg.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["tree/groups"] == 8
    assert record["budget/tool_calls"] > 0  # searches ran, through the actor
    assert record["budget/leaves"] == 8 * 2 * 2

    # The in-process loop builds its own retriever over the same corpus: the same passages, so
    # the same trees and the same step.
    local = LocalRun(cfg, uniform_policy).step()
    for key in ("budget/tool_calls", "budget/generated_tokens", "tree/reward_mean"):
        assert local[key] == record[key], key
