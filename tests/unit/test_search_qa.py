"""The Search-R1 style retrieval-QA environment: parsing, turn limit, rewards, immutability,
batched searches, configuration, the GPU presets and ``make_env``."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from treegrpo_ray.actors.rollout_worker import make_env
from treegrpo_ray.config import TaskConfig, load_config
from treegrpo_ray.envs.base import EpisodeState, Sample
from treegrpo_ray.envs.multihop import MultihopEnv
from treegrpo_ray.envs.qa_data import Passage
from treegrpo_ray.envs.search_qa import (
    INVALID_OBSERVATION,
    SearchQAConfig,
    SearchQAEnv,
    SearchQATask,
    check_model_path,
    format_passages,
    parse_action,
)
from treegrpo_ray.errors import UserInputError

SAMPLE = Sample("q1", "who wrote the novel Xylo?", ("Jane Doe", "J. Doe"))


class FakeSearch:
    """A batched search tool that records its calls and returns ``k`` made-up passages per query:
    ``Passage("<query>/<i>", "T<i>", "about <query>")``."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append((list(queries), k))
        return [
            [Passage(f"{q}/{i}", f"T{i}", f"about {q}") for i in range(1, k + 1)] for q in queries
        ]


def make(max_turns: int = 4, top_k: int = 3) -> tuple[SearchQAEnv, FakeSearch]:
    search = FakeSearch()
    return SearchQAEnv(SearchQAConfig(max_turns=max_turns, top_k=top_k), search), search


def run(env: SearchQAEnv, actions: list[str]) -> EpisodeState:
    _, state = env.reset(SAMPLE)
    for action in actions:
        state = env.step(state, action).state
    return state


def test_prompt_is_the_instruction_then_the_question():
    env, _ = make()
    prompt, state = env.reset(SAMPLE)
    assert prompt.endswith("Question: who wrote the novel Xylo?\n")
    for tag in ("<think>", "<search> query </search>", "<information>", "<answer>"):
        assert tag in prompt
    assert state == EpisodeState(SAMPLE)
    assert env.stop_sequences == ("</search>", "</answer>")


def test_search_after_free_reasoning_returns_top_k_passages():
    env, search = make()
    _, state = env.reset(SAMPLE)
    result = env.step(state, "<think> I need the author. </think>\n<search> Xylo author </search>")
    assert search.calls == [(["Xylo author"], 3)]
    assert result.observation == (
        "\n\n<information>Doc 1(Title: T1) about Xylo author\n"
        "Doc 2(Title: T2) about Xylo author\n"
        "Doc 3(Title: T3) about Xylo author\n</information>\n\n"
    )
    assert (result.role, result.tool_call, result.done) == ("search", True, False)
    assert result.state == EpisodeState(SAMPLE, turn=1)


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("<search> a </search>", ("search", "a")),
        ("<think> x </think> <answer> Jane Doe </answer>", ("answer", "Jane Doe")),
        ("<search> a </search> then <answer> b </answer>", ("answer", "b")),  # the last pair
        ("<answer> b </answer> no, <search> c\nd </search>", ("search", "c\nd")),
        ("<search>   </search>", ("invalid", None)),  # empty query
        ("<search> a </answer>", ("invalid", None)),  # tags do not pair
        ("the answer is Jane Doe", ("invalid", None)),
    ],
)
def test_parse_action_reads_the_last_tag_pair(text, parsed):
    assert parse_action(text) == parsed


def test_an_invalid_action_costs_a_turn_marks_the_format_and_searches_nothing():
    env, search = make()
    _, state = env.reset(SAMPLE)
    result = env.step(state, "I think it is Jane Doe.")
    assert result.observation == INVALID_OBSERVATION
    assert (result.role, result.tool_call, result.done) == ("invalid", False, False)
    assert result.state == EpisodeState(SAMPLE, turn=1, format_valid=False)
    assert search.calls == []


def test_the_max_turns_th_action_ends_the_episode_without_its_search():
    env, search = make(max_turns=4)
    _, state = env.reset(SAMPLE)
    for turn in (1, 2, 3):
        result = env.step(state, f"<search> q{turn} </search>")
        state = result.state
        assert (result.done, result.tool_call) == (False, True)
    last = env.step(state, "<search> q4 </search>")
    assert (last.observation, last.done, last.tool_call, last.role) == ("", True, False, "search")
    assert [queries for queries, _ in search.calls] == [["q1"], ["q2"], ["q3"]]  # no q4
    assert last.state.answer is None and last.state.turn == 4
    assert env.reward(last.state) == 0.0 and not env.success(last.state)
    with pytest.raises(ValueError, match="finished episode"):
        env.step(last.state, "<answer> Jane Doe </answer>")


def test_an_answer_on_the_last_turn_still_counts():
    env, _ = make(max_turns=2)
    state = run(env, ["<search> q </search>", "<answer> Jane Doe </answer>"])
    assert state.done and state.answer == "Jane Doe" and env.reward(state) == 1.0


@pytest.mark.parametrize(
    "actions, reward, success",
    [
        (["<search> q </search>", "<answer> the jane doe </answer>"], 1.0, True),  # normalised EM
        (["<answer> J. Doe </answer>"], 1.0, True),  # any gold answer
        (["oops", "<answer> Jane Doe </answer>"], 0.8, True),  # correct, format invalid
        (["<search> q </search>", "<answer> John Roe </answer>"], 0.2, False),  # wrong, valid
        (["<search></search>", "<answer> John Roe </answer>"], 0.1, False),  # wrong, invalid
        (["x", "y", "z", "w"], 0.0, False),  # no answer within max_turns = 4
    ],
)
def test_reward_is_format_aware_exact_match(actions, reward, success):
    env, _ = make()
    state = run(env, actions)
    assert state.done
    assert env.reward(state) == reward
    assert env.success(state) is success


def test_step_never_mutates_its_state_and_branches_are_repeatable():
    env, _ = make()
    _, root = env.reset(SAMPLE)
    first = env.step(root, "<search> a </search>").state
    snapshot = dataclasses.replace(first)
    branch_a = env.step(first, "<answer> Jane Doe </answer>")
    branch_b = env.step(first, "nonsense")
    assert first == snapshot == EpisodeState(SAMPLE, turn=1)
    assert branch_a.state.answer == "Jane Doe" and branch_b.state.format_valid is False
    assert env.step(first, "<answer> Jane Doe </answer>") == branch_a
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.turn = 5  # type: ignore[misc]


def test_step_batch_makes_one_search_call_and_equals_step_one_by_one():
    env, search = make()
    _, root = env.reset(SAMPLE)
    deeper = env.step(root, "<search> first </search>").state
    states = [root, deeper, root, root, deeper, root]
    actions = [
        "<search> alpha </search>",
        "<think> hm </think><search> beta </search>",
        "<answer> Jane Doe </answer>",
        "no tags",
        "<search> gamma </search>",
        "<search> delta </search>",
    ]
    search.calls.clear()
    batched = env.step_batch(states, actions)
    assert search.calls == [(["alpha", "beta", "gamma", "delta"], 3)]  # one call, batch order

    one_env, one_search = make()
    one_by_one = [one_env.step(s, a) for s, a in zip(states, actions, strict=True)]
    assert batched == one_by_one
    assert len(one_search.calls) == 4  # one call per searching branch
    assert [r.role for r in batched] == [
        "search",
        "search",
        "answer",
        "invalid",
        "search",
        "search",
    ]


def test_step_batch_without_searches_calls_nothing_and_checks_its_inputs():
    env, search = make()
    _, root = env.reset(SAMPLE)
    results = env.step_batch([root, root], ["<answer> a </answer>", "bad"])
    assert search.calls == [] and [r.role for r in results] == ["answer", "invalid"]
    with pytest.raises(ValueError, match="2 states but 1 actions"):
        env.step_batch([root, root], ["<answer> a </answer>"])
    broken = SearchQAEnv(SearchQAConfig(), lambda queries, k: [])
    with pytest.raises(RuntimeError, match="0 results for 1 queries"):
        broken.step(root, "<search> a </search>")


def test_a_search_without_results_says_so():
    assert format_passages([]) == "\n\n<information>No passages found.\n</information>\n\n"


def test_the_tiny_word_level_model_is_refused_for_search_qa():
    with pytest.raises(
        UserInputError, match="search_qa needs a Hugging Face model: set model.path"
    ):
        check_model_path("search_qa", None)
    check_model_path("search_qa", "/models/Qwen2.5-3B")
    check_model_path("multihop", None)


def test_config_errors_name_the_field_and_the_fix():
    with pytest.raises(ValidationError, match="fixture is true but search_qa.train_path is set"):
        SearchQAConfig(fixture=True, train_path="/data/train.parquet")
    with pytest.raises(ValidationError, match="train_path='/data/train.csv' has an unknown ext"):
        SearchQAConfig(train_path="/data/train.csv")
    with pytest.raises(ValidationError, match="corpus_path='/data/wiki.parquet' must be a .jsonl"):
        SearchQAConfig(corpus_path="/data/wiki.parquet")
    with pytest.raises(ValidationError, match="dense_model is null"):
        SearchQAConfig(retriever="dense")
    with pytest.raises(ValidationError, match="set search_qa.heldout_path, search_qa.corpus_path"):
        TaskConfig(name="search_qa", search_qa=SearchQAConfig(train_path="/d/train.parquet"))
    TaskConfig(name="multihop")  # the unused search_qa section needs no data
    with pytest.raises(UserInputError, match=r"^invalid config tiny-multihop: task: .*fixture"):
        load_config("tiny-multihop", ["task.name=search_qa"])


@pytest.mark.parametrize(
    "preset, model",
    [
        ("qwen2.5-3b-search-r1", "/models/Qwen2.5-3B"),
        ("llama-3.2-3b-search-r1", "/models/Llama-3.2-3B"),
    ],
)
def test_gpu_presets_load_with_the_documented_placeholders(preset, model):
    cfg = load_config(preset)
    qa = cfg.task.search_qa
    assert (cfg.name, cfg.task.name, cfg.model.path) == (preset, "search_qa", model)
    assert qa.train_path == "/data/search-r1/nq_hotpotqa_train/train.parquet"
    assert qa.heldout_path == "/data/search-r1/nq_hotpotqa_train/test.parquet"
    assert qa.corpus_path == "/data/search-r1/wiki-18.jsonl"
    assert (qa.retriever, qa.top_k, qa.max_turns, qa.fixture) == ("bm25", 3, 4, False)
    assert (cfg.engine.kind, cfg.cluster.learner_gpus) == ("vllm", 1)
    assert (cfg.tree.m, cfg.tree.n, cfg.tree.l, cfg.ppo.lr) == (2, 2, 1, 1e-6)


def test_fixture_task_needs_no_files():
    task = SearchQATask(SearchQAConfig(fixture=True, heldout_questions=5))
    train, heldout = task.train_samples(), task.heldout_samples()
    assert (len(train), len(heldout)) == (80, 5)
    assert not {s.uid for s in train} & {s.uid for s in heldout}


def test_make_env_builds_search_qa_with_its_retriever_or_the_given_search():
    task = TaskConfig(name="search_qa", search_qa=SearchQAConfig(fixture=True))
    env = make_env(task)
    sample = SearchQATask(task.search_qa).train_samples()[0]
    assert sample.question == "In which year was the city where Brilowen Cozelgal was born founded?"
    # Two hops through the in-process BM25 retriever: the person's passage names the city Morhes,
    # whose passage holds the answer 1893.
    _, state = env.reset(sample)
    first = env.step(state, "<think> who? </think>\n<search> Brilowen Cozelgal </search>")
    assert first.observation == (  # the only passage sharing a word with the query
        "\n\n<information>Doc 1(Title: Brilowen Cozelgal) Brilowen Cozelgal is an architect who "
        "was born in the city of Morhes and works for the Ulmqenta Brewery.\n</information>\n\n"
    )
    second = env.step(first.state, "<search> Morhes founded </search>")
    assert (
        "Doc 1(Title: Morhes) Morhes is a city located in the country of Brinarmor, founded "
        "in the year 1893.\n" in second.observation
    )
    last = env.step(second.state, "<answer> 1893 </answer>")
    assert env.reward(last.state) == 1.0

    fake = FakeSearch()
    with_fake = make_env(task, search=fake)
    with_fake.step(state, "<search> anything </search>")
    assert fake.calls == [(["anything"], 3)]
    assert isinstance(make_env(TaskConfig()), MultihopEnv)
