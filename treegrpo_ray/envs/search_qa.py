"""Search-R1 style retrieval QA: the policy searches a corpus, reads passages, then answers.

The text protocol (every action ends at a stop sequence, ``</search>`` or ``</answer>``)::

    prompt:  "Answer the given question. ... Question: who wrote X?\\n"
    action:  "<think> I need the author of X. </think>\\n<search> X author </search>"
    obs:     "\\n\\n<information>Doc 1(Title: X) X is a novel by ...\\nDoc 2(...) ...\\n</information>\\n\\n"
    action:  "<think> ... </think>\\n<answer> Jane Doe </answer>"
    obs:     ""  (the episode is over)

``step`` reads the last ``<search>``/``<answer>`` tag pair of the action (free text before it, such
as ``<think>...</think>``, is allowed). The reward is the paper's format-aware exact match
(``treegrpo_ray.rewards.format_aware_em``). The search tool is a batched callable
``search(queries, k) -> passages per query`` (``treegrpo_ray.actors.retriever.Retriever.search_batch`` in-process,
or the client of the retriever actor); ``step_batch`` sends all the searches of a batch in one call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from treegrpo_ray.envs.base import EpisodeState, Sample, StepResult
from treegrpo_ray.envs.qa_data import QUESTION_SUFFIXES, Passage, load_samples, search_r1_prompt
from treegrpo_ray.envs.qa_fixture import MAX_HELDOUT, TEST_QUESTIONS, QAFixture, build_fixture
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.rewards import exact_match, format_aware_em

SearchFn = Callable[[list[str], int], list[list[Passage]]]
"""``search(queries, k)``: for each query, up to ``k`` passages, best first."""

_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
INVALID_OBSERVATION = (
    "\nMy previous action is invalid. To search, I should put the query between <search> and "
    "</search>. To give the final answer, I should put it between <answer> and </answer>. "
    "Let me try again.\n"
)
NO_RESULTS = "No passages found."


class SearchQAConfig(BaseModel, extra="forbid"):
    """Retrieval QA data (files or the built-in fixture), retriever and episode length."""

    fixture: bool = Field(
        False,
        description="Use the built-in synthetic corpus and questions "
        "(treegrpo_ray/envs/qa_fixture.py) instead of files; the paths must then be null.",
    )
    fixture_seed: int = Field(0, description="Seed of the built-in fixture.")
    fixture_heldout: int = Field(
        TEST_QUESTIONS,
        ge=TEST_QUESTIONS,
        le=MAX_HELDOUT,
        description="Held-out questions of the built-in fixture: its first 20, and beyond them more "
        "drawn from the same generator (the train questions stay the same). 200 tell a 10-point "
        "difference in exact match apart; 20 make one question 5 points.",
    )
    train_path: str | None = Field(
        None,
        description="Train questions: Search-R1 .parquet or FlashRAG .jsonl/.json (by extension).",
    )
    heldout_path: str | None = Field(
        None, description="Held-out questions for evaluation, same formats as train_path."
    )
    corpus_path: str | None = Field(
        None, description="Corpus .jsonl, one {id, contents: '\"Title\"\\ntext'} per line."
    )
    retriever: Literal["bm25", "dense"] = Field(
        "bm25", description="bm25: bm25s; dense: sentence-transformers + faiss (the dense extra)."
    )
    dense_model: str | None = Field(
        None, description="Sentence-transformers model directory (e.g. e5-base-v2) for dense."
    )
    index_path: str | None = Field(
        None,
        description="bm25: directory caching the index (built and saved when empty); dense: a "
        "prebuilt faiss index over the corpus (null: encode the corpus at start).",
    )
    top_k: int = Field(3, ge=1, description="Passages returned per search.")
    max_turns: int = Field(
        4, ge=1, description="Actions per episode; the episode ends without an answer after them."
    )
    heldout_questions: int = Field(
        1024, ge=1, description="Held-out questions kept (the first ones of heldout_path)."
    )

    @model_validator(mode="after")
    def _check_sources(self) -> SearchQAConfig:
        paths = {
            "train_path": self.train_path,
            "heldout_path": self.heldout_path,
            "corpus_path": self.corpus_path,
        }
        given = [name for name, value in paths.items() if value is not None]
        if self.fixture and given:
            raise ValueError(
                f"search_qa.fixture is true but search_qa.{given[0]} is set; use either the "
                "built-in fixture or your files, not both"
            )
        for name in ("train_path", "heldout_path"):
            value = paths[name]
            if value is not None and Path(value).suffix not in QUESTION_SUFFIXES:
                raise ValueError(
                    f"search_qa.{name}={value!r} has an unknown extension; use a Search-R1 "
                    ".parquet or a FlashRAG .jsonl/.json file"
                )
        if self.corpus_path is not None and Path(self.corpus_path).suffix != ".jsonl":
            raise ValueError(
                f"search_qa.corpus_path={self.corpus_path!r} must be a .jsonl corpus "
                "(one {id, contents} object per line)"
            )
        if self.retriever == "dense" and self.dense_model is None:
            raise ValueError(
                "search_qa.retriever is dense but search_qa.dense_model is null; set it to a "
                "sentence-transformers model directory (e.g. /models/e5-base-v2)"
            )
        return self

    def check_sources(self) -> None:
        """Raise ``ValueError`` unless the data is fully given (the fixture or all three paths)."""
        missing = [
            name
            for name in ("train_path", "heldout_path", "corpus_path")
            if getattr(self, name) is None
        ]
        if not self.fixture and missing:
            raise ValueError(
                f"task search_qa needs data: set search_qa.{', search_qa.'.join(missing)} "
                "(docs/search_qa.md) or search_qa.fixture: true"
            )


def check_model_path(task_name: str, model_path: str | None) -> None:
    """Refuse the tiny word-level model (``model.path: null``) for a task it cannot read.

    The tiny model's tokenizer knows only the multihop task's words; search_qa needs a Hugging Face
    model directory. Call before resolving (warm-starting) the policy.
    """
    if task_name == "search_qa" and model_path is None:
        raise UserInputError(
            "task.name search_qa needs a Hugging Face model: set model.path (e.g. "
            "/models/Qwen2.5-3B, or a Hub id such as Qwen/Qwen2.5-3B) or "
            "model.pretrained=smollm2-135m; the tiny model built when both are null is "
            "word-level and only supports the multihop task"
        )


class SearchQATask:
    """Train / held-out questions of a :class:`SearchQAConfig` (files or the fixture)."""

    def __init__(self, cfg: SearchQAConfig) -> None:
        self.cfg = cfg

    @cached_property
    def _fixture(self) -> QAFixture:
        return build_fixture(self.cfg.fixture_seed, self.cfg.fixture_heldout)

    def _load(self, path: str | None, limit: int | None = None) -> list[Sample]:
        if path is None:
            raise UserInputError("search_qa: no data files set; set the paths or fixture: true")
        return load_samples(path, limit)

    @cached_property
    def _train(self) -> list[Sample]:
        if self.cfg.fixture:
            return list(self._fixture.train)
        return self._load(self.cfg.train_path)

    @cached_property
    def _heldout(self) -> list[Sample]:
        if self.cfg.fixture:
            return list(self._fixture.test[: self.cfg.heldout_questions])
        return self._load(self.cfg.heldout_path, self.cfg.heldout_questions)

    def train_samples(self) -> list[Sample]:
        """Every train question, in file order."""
        return list(self._train)

    def heldout_samples(self) -> list[Sample]:
        """The first ``heldout_questions`` held-out questions."""
        return list(self._heldout)


def parse_action(action_text: str) -> tuple[str, str | None]:
    """``("search"|"answer", content)`` from the last tag pair, else ``("invalid", None)``.

    Empty content (``<search> </search>``) is invalid.
    """
    matches = _TAG.findall(action_text)
    if not matches:
        return "invalid", None
    role, content = matches[-1]
    content = content.strip()
    return (role, content) if content else ("invalid", None)


def format_passages(passages: Sequence[Passage]) -> str:
    """The observation of one search: ``<information>Doc i(Title: T) text ...</information>``."""
    docs = [f"Doc {i}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages, start=1)]
    body = "".join(docs) or f"{NO_RESULTS}\n"
    return f"\n\n<information>{body}</information>\n\n"


class SearchQAEnv:
    """The AgentEnv of retrieval QA; ``search`` is the batched search tool (see module docs)."""

    stop_sequences: tuple[str, ...] = ("</search>", "</answer>")

    def __init__(self, cfg: SearchQAConfig, search: SearchFn) -> None:
        self.cfg = cfg
        self.search = search

    def reset(self, sample: Sample) -> tuple[str, EpisodeState]:
        """The Search-R1 instruction prompt for the question, and the initial state."""
        return search_r1_prompt(sample.question), EpisodeState(sample)

    def _apply(self, state: EpisodeState, action_text: str) -> tuple[StepResult, str | None]:
        """The step's result and the query it must run (None: no search; observation still "")."""
        if state.done:
            raise ValueError(f"step called on a finished episode (sample {state.sample.uid})")
        role, content = parse_action(action_text)
        new = replace(state, turn=state.turn + 1, format_valid=state.format_valid and bool(content))
        if role == "answer":
            return StepResult("", replace(new, answer=content, done=True), True, role, False), None
        if new.turn >= self.cfg.max_turns:
            return StepResult("", replace(new, done=True), True, role, False), None
        if role == "invalid":
            return StepResult(INVALID_OBSERVATION, new, False, role, False), None
        return StepResult("", new, False, role, True), content

    def step(self, state: EpisodeState, action_text: str) -> StepResult:
        """Apply one action; the input state is left untouched (it is frozen).

        An answer ends the episode; so does the ``max_turns``-th action of any kind, without
        running its search (observation "", ``tool_call`` False, reward 0 without an answer).
        An action with neither tag costs a turn and marks the trajectory's format invalid.
        """
        return self.step_batch([state], [action_text])[0]

    def step_batch(
        self, states: Sequence[EpisodeState], action_texts: Sequence[str]
    ) -> list[StepResult]:
        """``step`` over many branches with every search of the batch in ONE ``search`` call
        (none when no branch searches)."""
        if len(states) != len(action_texts):
            raise ValueError(f"{len(states)} states but {len(action_texts)} actions")
        applied = [self._apply(s, a) for s, a in zip(states, action_texts, strict=True)]
        queries = [query for _, query in applied if query is not None]
        found = self.search(queries, self.cfg.top_k) if queries else []
        if len(found) != len(queries):
            raise RuntimeError(f"search returned {len(found)} results for {len(queries)} queries")
        results, answers = [], iter(found)
        for result, query in applied:
            if query is not None:
                result = replace(result, observation=format_passages(next(answers)))
            results.append(result)
        return results

    def reward(self, state: EpisodeState) -> float:
        """Format-aware exact match: 1.0 / 0.8 / 0.2 / 0.1, or 0.0 without an answer."""
        return format_aware_em(state.answer, state.sample.answers, state.format_valid)

    def success(self, state: EpisodeState) -> bool:
        """Whether the answer given is correct (exact match), whatever the format."""
        return state.answer is not None and exact_match(state.answer, state.sample.answers) == 1.0
