"""The synthetic multi-hop environment: determinism, splits, rewards, immutability, batching."""

from __future__ import annotations

import dataclasses
import random

import pytest
from pydantic import ValidationError

from treegrpo_ray.envs.multihop import (
    TEMPLATES,
    MultihopConfig,
    MultihopEnv,
    MultihopTask,
    parse_action,
)


@pytest.fixture(scope="module")
def task() -> MultihopTask:
    return MultihopTask(MultihopConfig(train_questions=256, heldout_questions=64))


@pytest.fixture(scope="module")
def env(task: MultihopTask) -> MultihopEnv:
    return MultihopEnv(task)


def search(entity: str) -> str:
    return f"<search> {entity} </search>"


def answer(entity: str) -> str:
    return f"<answer> {entity} </answer>"


def test_knowledge_base_is_pinned_for_seed_0(task):
    # 180 entities: 180 // 9 = 20 countries, 180 // 6 = 30 cities and 30 companies, 100 persons.
    assert {t: len(e) for t, e in task.kb.entities.items()} == {"k": 20, "y": 30, "c": 30, "p": 100}
    assert task.kb.facts["p0"] == (("p0", "works_for", "c10"), ("p0", "born_in", "y26"))
    sample = task.make_sample("x", 13, "p0")
    assert sample.question == (
        "what is the capital of the country where the employer of p0 is based ?"
    )
    # p0 works_for c10, c10 based_in k18, k18 capital y2.
    assert dict(sample.meta) == {"template": 13, "hops": 3, "path": ("p0", "c10", "k18", "y2")}
    assert sample.answers == ("y2",)


def test_same_seed_same_task_other_seed_other_task(task):
    cfg = MultihopConfig(train_questions=256, heldout_questions=64)
    again = MultihopTask(cfg)
    assert again.kb == task.kb
    assert again.train_samples() == task.train_samples()
    assert again.heldout_samples() == task.heldout_samples()
    other = MultihopTask(cfg.model_copy(update={"seed": 1}))
    assert other.kb.facts != task.kb.facts
    assert other.train_samples() != task.train_samples()


def test_heldout_combinations_never_appear_in_train(task):
    def combos(samples):
        return {(dict(s.meta)["template"], dict(s.meta)["path"][0]) for s in samples}

    train, held = combos(task.train_samples()), combos(task.heldout_samples())
    assert train.isdisjoint(held)
    assert set(task.combinations("train")).isdisjoint(task.combinations("heldout"))
    # Every template is in both splits: 20% of its start entities are held out.
    assert {t for t, _ in task.combinations("heldout")} == set(range(len(TEMPLATES)))
    assert {t for t, _ in task.combinations("train")} == set(range(len(TEMPLATES)))
    # 6 person templates x 20 + 5 company x 6 + 2 city x 6 + 3 country x 4 = 174 held out.
    assert len(task.combinations("heldout")) == 174
    assert len(task.train_samples()) == 256 and len(task.heldout_samples()) == 64
    assert len({s.uid for s in task.train_samples()}) == 256


def test_expert_trajectory_gets_full_reward(task, env):
    sample = task.make_sample("x", 13, "p0")  # path p0 -> c10 -> k18 -> y2
    prompt, state = env.reset(sample)
    assert prompt == (
        "<question> what is the capital of the country where the employer of p0 is based ? "
        "</question> "
    )
    actions = env.demonstration(sample, random.Random(0), noise=0.0)
    assert actions == [search("p0"), search("c10"), search("k18"), answer("y2")]
    results = []
    for action in actions:
        results.append(env.step(state, action))
        state = results[-1].state
    assert [r.role for r in results] == ["search", "search", "search", "answer"]
    assert [r.tool_call for r in results] == [True, True, True, False]
    assert [r.done for r in results] == [False, False, False, True]
    assert "p0 works_for c10 ." in results[0].observation
    assert "c10 based_in k18 ." in results[1].observation
    assert "k18 capital y2 ." in results[2].observation
    assert results[3].observation == ""
    assert (state.answer, state.turn, state.format_valid) == ("y2", 4, True)
    assert env.reward(state) == 1.0


def test_observation_format(task, env):
    _, state = env.reset(task.make_sample("x", 0, "p0"))
    obs = env.step(state, search("p0")).observation
    assert obs.startswith(" <info> ") and obs.endswith(" </info> ")
    facts = obs.split()[1:-1]
    # 2 facts of p0 + 2 distractor facts, 4 words each (SUBJ REL OBJ .).
    assert len(facts) == 16 and facts[3::4] == ["."] * 4
    assert sorted(facts[0::4]).count("p0") == 2
    assert set(obs.split()) <= set(task.vocabulary())
    assert env.step(state, search("p999")).observation == " <info> none </info> "
    assert env.step(state, search("p999")).tool_call is True


def test_wrong_answer_scores_0_2(task, env):
    _, state = env.reset(task.make_sample("x", 0, "p0"))  # gold: c10
    state = env.step(state, search("p0")).state
    result = env.step(state, answer("c11"))
    assert (result.done, result.role, result.tool_call) == (True, "answer", False)
    assert env.reward(result.state) == 0.2


def test_invalid_action_then_correct_answer_scores_0_8(task, env):
    _, state = env.reset(task.make_sample("x", 0, "p0"))
    bad = env.step(state, "<search> p0")
    assert (bad.observation, bad.role, bad.tool_call, bad.done) == (
        " <info> invalid </info> ",
        "invalid",
        False,
        False,
    )
    assert bad.state.turn == 1 and bad.state.format_valid is False
    state = env.step(bad.state, search("p0")).state
    final = env.step(state, answer("c10"))
    assert final.state.turn == 3
    assert env.reward(final.state) == 0.8
    assert env.reward(env.step(state, answer("c11")).state) == 0.1


def test_turn_limit_ends_without_reward(task, env):
    _, state = env.reset(task.make_sample("x", 0, "p0"))
    results = []
    for _ in range(5):  # max_turns = 5 searches, no answer
        results.append(env.step(state, search("p0")))
        state = results[-1].state
    assert [r.done for r in results] == [False] * 4 + [True]
    assert results[-1].observation == "" and results[-1].tool_call is False
    assert state.answer is None and state.done
    assert env.reward(state) == 0.0
    with pytest.raises(ValueError, match="finished episode"):
        env.step(state, answer("c10"))


def test_step_never_mutates_and_branches_reproduce(task, env):
    _, root = env.reset(task.make_sample("x", 13, "p0"))
    child = env.step(root, search("p0")).state
    before = dataclasses.astuple(child)
    first = env.step(child, search("c10"))
    second = env.step(child, search("c10"))
    assert dataclasses.astuple(child) == before and child.turn == 1
    assert first == second  # the same branch sees the same observation
    other_entity = env.step(child, search("c11"))
    assert other_entity.observation != first.observation
    with pytest.raises(dataclasses.FrozenInstanceError):
        child.turn = 5  # type: ignore[misc]


def test_step_batch_equals_step_one_by_one(task, env):
    samples = task.train_samples()[:8]
    states = [env.reset(s)[1] for s in samples]
    actions = [search(dict(s.meta)["path"][0]) for s in samples]
    actions[3], actions[5] = "nonsense", answer(samples[5].answers[0])
    assert env.step_batch(states, actions) == [
        env.step(s, a) for s, a in zip(states, actions, strict=True)
    ]
    with pytest.raises(ValueError, match="2 states but 1 actions"):
        env.step_batch(states[:2], actions[:1])


def test_parse_action():
    assert parse_action("<search> p3 </search>") == ("search", "p3")
    assert parse_action("  <answer>  k1 </answer>") == ("answer", "k1")
    assert parse_action("<answer> k1 k2 </answer>") == ("invalid", None)
    assert parse_action("<search> p3 </answer>") == ("invalid", None)


def test_noisy_demonstrations_make_plausible_mistakes(task, env):
    rng = random.Random(0)
    rewards, lengths = [], []
    for sample in task.train_samples()[:200]:
        _, state = env.reset(sample)
        actions = env.demonstration(sample, rng, noise=1.0)
        for action in actions:
            state = env.step(state, action).state
        rewards.append(env.reward(state))
        lengths.append(len(actions) - dict(sample.meta)["hops"] - 1)
    # Every trajectory is well formed; wrong/early answers score 0.2, a recovered search 1.0.
    assert set(rewards) == {0.2, 1.0}
    assert set(lengths) == {-2, -1, 0, 1}  # skipped 2 hops, skipped 1, same length, extra search
    assert all(r == 1.0 for r, n in zip(rewards, lengths, strict=True) if n == 1)


def test_vocabulary_covers_prompts_and_actions(task, env):
    vocab = set(env.vocabulary())
    assert len(vocab) == len(env.vocabulary()) == 217
    for sample in task.heldout_samples():
        prompt, _ = env.reset(sample)
        assert set(prompt.split()) <= vocab


def test_config_validation():
    with pytest.raises(ValidationError, match="max_turns=3 cannot solve 3-hop"):
        MultihopConfig(max_turns=3)
    with pytest.raises(ValidationError, match="extra"):
        MultihopConfig(num_entity=10)
    with pytest.raises(ValidationError, match="greater than or equal to 36"):
        MultihopConfig(num_entities=10)
