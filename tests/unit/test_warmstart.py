"""Supervised warm start: learning, caching and determinism, on a very small model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treegrpo_ray.config import TinyModelConfig, WarmStartConfig
from treegrpo_ray.envs.multihop import MultihopConfig, MultihopEnv, MultihopTask
from treegrpo_ray.learners.warmstart import (
    LOG_NAME,
    accumulate_gradients,
    cache_key,
    collate,
    demonstration_tokens,
    warm_start,
)
from treegrpo_ray.modeling import build_tiny_model, load_policy

TASK = MultihopConfig(train_questions=128, heldout_questions=16)
MODEL = TinyModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
)


def small(cache_dir, **kw) -> WarmStartConfig:
    return WarmStartConfig(steps=40, batch_size=8, lr=1e-2, cache_dir=str(cache_dir), **kw)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cfg = small(tmp_path_factory.mktemp("cache_a"))
    return cfg, warm_start(TASK, MODEL, cfg, progress=False)


def test_loss_falls_and_policy_loads(first_run):
    cfg, path = first_run
    log = json.loads((path / LOG_NAME).read_text())
    losses = log["losses"]
    assert len(losses) == 40
    # ln(217 + 3 words) = 5.39 at initialisation; 40 steps bring the action loss well below.
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    model, tokenizer = load_policy(path)
    assert model.config.hidden_size == 32 and len(tokenizer) == 220
    assert (path / "model.safetensors").is_file()


def test_cache_is_reused_without_training(first_run):
    cfg, path = first_run
    assert path.parent == Path(cfg.cache_dir)
    assert path.name == cache_key(TASK, MODEL, cfg)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    log_stamp = (path / LOG_NAME).stat().st_mtime_ns
    assert warm_start(TASK, MODEL, cfg, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert (path / LOG_NAME).stat().st_mtime_ns == log_stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left behind


def test_same_seed_same_weights_other_seed_other_weights(first_run, tmp_path):
    cfg, path = first_run
    again = warm_start(TASK, MODEL, small(tmp_path / "b"), progress=False)
    assert again != path and again.name == path.name  # same key, another cache dir
    ours, theirs = load_file(path / "model.safetensors"), load_file(again / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    other = warm_start(TASK, MODEL, small(tmp_path / "c", seed=1), progress=False)
    assert other.name != path.name
    weights = load_file(other / "model.safetensors")
    assert not torch.equal(weights["model.embed_tokens.weight"], ours["model.embed_tokens.weight"])


def test_cache_key_covers_every_config_but_not_the_location(tmp_path):
    base = small(tmp_path)
    key = cache_key(TASK, MODEL, base)
    assert cache_key(TASK, MODEL, small(tmp_path / "elsewhere")) == key
    assert cache_key(TASK.model_copy(update={"seed": 1}), MODEL, base) != key
    assert cache_key(TASK, MODEL.model_copy(update={"num_layers": 2}), base) != key
    assert cache_key(TASK, MODEL, base.model_copy(update={"noise": 0.1})) != key


def test_demonstration_tokens_mask_only_actions():
    task = MultihopTask(TASK)
    env = MultihopEnv(task)
    vocab = {w: i + 3 for i, w in enumerate(task.vocabulary())}
    sample = task.make_sample("x", 0, "p0")  # who is the employer of p0 ? -> c10
    ids, mask = demonstration_tokens(env, vocab, sample, random.Random(0), noise=0.0)
    words = {i: w for w, i in vocab.items()}
    actions = [words[i] for i, m in zip(ids, mask, strict=True) if m]
    assert actions == ["<search>", "p0", "</search>", "<answer>", "c10", "</answer>"]
    # prompt (9 words) + search (3) + info (2 + 4 facts * 4) + answer (3)
    assert len(ids) == 9 + 3 + 18 + 3
    assert mask[:9] == [False] * 9 and mask[-3:] == [True] * 3


def test_split_gradient_accumulation_equals_one_batch():
    task = MultihopTask(TASK)
    env = MultihopEnv(task)
    vocab = {w: i + 3 for i, w in enumerate(task.vocabulary())}
    rng = random.Random(0)
    batch = [demonstration_tokens(env, vocab, s, rng, 0.4) for s in task.train_samples()[:7]]
    model = build_tiny_model(MODEL, len(vocab) + 3, seed=0)
    reference = model(**collate(batch)).loss
    reference.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert accumulate_gradients(model, batch) == pytest.approx(reference.item(), rel=1e-6)
    for ref, got in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_protocol_warmstart_key_ignores_how_many_heldout_questions_there_are():
    """The protocol warm start trains on the train questions: a larger held-out split (or fewer
    held-out questions kept) reuses the cached warm start; the retrieval settings do not."""
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.protocol_warmstart import cache_key

    base = Path("/models/smollm2-135m")
    key = cache_key(load_config("smollm2-135m-search-qa"), base)
    more = ["task.search_qa.fixture_heldout=300", "task.search_qa.heldout_questions=300"]
    assert cache_key(load_config("smollm2-135m-search-qa", more), base) == key
    other = load_config("smollm2-135m-search-qa", ["task.search_qa.top_k=2"])
    assert cache_key(other, base) != key
