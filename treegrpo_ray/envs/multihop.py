"""A synthetic multi-hop knowledge-base task that a ~0.5M-parameter model can learn on CPU.

A seeded random knowledge base holds typed entities, each one word: persons ``p17``, companies
``c3``, cities ``y5`` and countries ``k2``. Facts are ``SUBJ REL OBJ .`` with the relations
``works_for`` (person->company), ``born_in`` (person->city), ``ceo`` (company->person),
``based_in`` (company->country), ``located_in`` (city->country), ``capital`` (country->city) and
``borders`` (country->country). Sixteen word-level templates ask 1- to 3-hop questions about a
start entity; the held-out split uses (template, start entity) combinations that train never shows.

The text format, one word per token (observations start with a space, so the concatenation
``prompt + action + observation + ...`` splits on white space into the same words)::

    prompt:  "<question> in which country was p17 born ? </question> "
    action:  "<search> p17 </search>"
    obs:     " <info> p17 works_for c3 . y8 located_in k1 . p17 born_in y5 . </info> "
    action:  "<search> y5 </search>"
    obs:     " <info> k4 capital y9 . y5 located_in k2 . c9 ceo p40 . </info> "
    action:  "<answer> k2 </answer>"
    obs:     ""  (the episode is over; reward 1.0)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from pydantic import BaseModel, Field, model_validator

from treegrpo_ray.envs.base import EpisodeState, Sample, StepResult
from treegrpo_ray.rewards import exact_match, format_aware_em

Fact = tuple[str, str, str]

# (start entity type, relations followed from the start entity, question words with {e}).
TEMPLATES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("p", ("works_for",), "who is the employer of {e} ?"),
    ("p", ("born_in",), "in which city was {e} born ?"),
    ("c", ("based_in",), "in which country is {e} based ?"),
    ("y", ("located_in",), "which country is {e} located in ?"),
    ("k", ("capital",), "what is the capital of {e} ?"),
    ("c", ("ceo",), "who is the ceo of {e} ?"),
    ("k", ("borders",), "which country does {e} border ?"),
    ("p", ("works_for", "based_in"), "in which country is the employer of {e} based ?"),
    ("p", ("born_in", "located_in"), "in which country was {e} born ?"),
    ("c", ("based_in", "capital"), "what is the capital of the country where {e} is based ?"),
    ("y", ("located_in", "capital"), "what is the capital of the country where {e} is located ?"),
    ("c", ("ceo", "born_in"), "in which city was the ceo of {e} born ?"),
    ("k", ("borders", "capital"), "what is the capital of the country that {e} borders ?"),
    (
        "p",
        ("works_for", "based_in", "capital"),
        "what is the capital of the country where the employer of {e} is based ?",
    ),
    (
        "p",
        ("born_in", "located_in", "capital"),
        "what is the capital of the country where {e} was born ?",
    ),
    ("c", ("ceo", "born_in", "located_in"), "in which country was the ceo of {e} born ?"),
)
RELATIONS = ("works_for", "born_in", "ceo", "based_in", "located_in", "capital", "borders")
MARKUP = ("<question>", "</question>", "<search>", "</search>", "<answer>", "</answer>")
INFO_WORDS = ("<info>", "</info>", "none", "invalid", ".")
MAX_HOPS = max(len(rels) for _, rels, _ in TEMPLATES)
HELDOUT_FRACTION = 0.2  # share of each template's start entities reserved for the held-out split


class MultihopConfig(BaseModel, extra="forbid"):
    """The synthetic multi-hop task: knowledge base, observation noise, episode length, splits."""

    seed: int = Field(0, description="Seed of the knowledge base, the splits and the distractors.")
    num_entities: int = Field(
        180,
        ge=36,
        description="Entities in the knowledge base, split ~55/17/17/11% into persons, companies, "
        "cities and countries.",
    )
    distractors: int = Field(
        2, ge=0, description="Facts about other random entities added to each search result."
    )
    max_turns: int = Field(
        5, ge=1, description="Actions per episode; the episode ends without an answer after them."
    )
    heldout_questions: int = Field(1024, ge=1, description="Questions in the held-out split.")
    train_questions: int = Field(4096, ge=1, description="Questions in the train split.")

    @model_validator(mode="after")
    def _turns_cover_longest_question(self) -> MultihopConfig:
        if self.max_turns < MAX_HOPS + 1:
            raise ValueError(
                f"multihop.max_turns={self.max_turns} cannot solve {MAX_HOPS}-hop questions "
                f"({MAX_HOPS} searches + 1 answer); set multihop.max_turns >= {MAX_HOPS + 1}"
            )
        return self


@dataclass(frozen=True)
class KnowledgeBase:
    """Entities by type (``p``/``c``/``y``/``k``) and every fact, grouped by subject."""

    entities: dict[str, tuple[str, ...]]
    facts: dict[str, tuple[Fact, ...]]

    def follow(self, subject: str, relation: str) -> str:
        """The object of the (unique) fact ``subject relation ?``."""
        return next(o for s, r, o in self.facts[subject] if r == relation)


def build_knowledge_base(num_entities: int, rng: random.Random) -> KnowledgeBase:
    """Random typed entities and facts; each company has an employee, each country a capital."""
    n_k, n_y, n_c = num_entities // 9, num_entities // 6, num_entities // 6
    counts = {"k": n_k, "y": n_y, "c": n_c, "p": num_entities - n_k - n_y - n_c}
    ents = {t: tuple(f"{t}{i}" for i in range(n)) for t, n in counts.items()}
    k, y, c, p = ents["k"], ents["y"], ents["c"], ents["p"]
    facts: dict[str, list[Fact]] = {e: [] for e in k + y + c + p}
    capitals = rng.sample(y, len(k))
    for country, city in zip(k, capitals, strict=True):
        facts[country].append((country, "capital", city))
        facts[country].append((country, "borders", rng.choice([o for o in k if o != country])))
        facts[city].append((city, "located_in", country))
    for city in y:
        if city not in capitals:
            facts[city].append((city, "located_in", rng.choice(k)))
    employers = list(c) + [rng.choice(c) for _ in range(len(p) - len(c))]
    rng.shuffle(employers)
    for person, company in zip(p, employers, strict=True):
        facts[person].append((person, "works_for", company))
        facts[person].append((person, "born_in", rng.choice(y)))
    for company in c:
        staff = [q for q, e in zip(p, employers, strict=True) if e == company]
        facts[company].append((company, "based_in", rng.choice(k)))
        facts[company].append((company, "ceo", rng.choice(staff)))
    return KnowledgeBase(ents, {e: tuple(f) for e, f in facts.items()})


class MultihopTask:
    """Knowledge base plus train / held-out questions for one :class:`MultihopConfig`."""

    def __init__(self, cfg: MultihopConfig) -> None:
        self.cfg = cfg
        self.kb = build_knowledge_base(cfg.num_entities, random.Random(f"kb-{cfg.seed}"))
        self._splits = self._split_combinations(random.Random(f"split-{cfg.seed}"))

    def _split_combinations(self, rng: random.Random) -> dict[str, list[tuple[int, str]]]:
        """(template, start entity) pairs; per template, a disjoint held-out share of the starts."""
        splits: dict[str, list[tuple[int, str]]] = {"train": [], "heldout": []}
        for t, (etype, _, _) in enumerate(TEMPLATES):
            starts = list(self.kb.entities[etype])
            rng.shuffle(starts)
            n_held = max(1, round(HELDOUT_FRACTION * len(starts)))
            splits["heldout"] += [(t, e) for e in starts[:n_held]]
            splits["train"] += [(t, e) for e in starts[n_held:]]
        return splits

    def combinations(self, split: str) -> list[tuple[int, str]]:
        """The (template index, start entity) pairs of ``split`` (``train`` or ``heldout``)."""
        return list(self._splits[split])

    def make_sample(self, uid: str, template: int, start: str) -> Sample:
        """The question of ``template`` about ``start``; meta: template, hops, entity path."""
        _, relations, text = TEMPLATES[template]
        path = [start]
        for rel in relations:
            path.append(self.kb.follow(path[-1], rel))
        meta = (("template", template), ("hops", len(relations)), ("path", tuple(path)))
        return Sample(uid=uid, question=text.format(e=start), answers=(path[-1],), meta=meta)

    def _samples(self, split: str, count: int) -> list[Sample]:
        """``count`` questions cycling through the split's combinations, reshuffled each cycle."""
        combos, rng = self.combinations(split), random.Random(f"{split}-{self.cfg.seed}")
        out: list[tuple[int, str]] = []
        while len(out) < count:
            rng.shuffle(combos)
            out += combos[: count - len(out)]
        return [self.make_sample(f"{split}-{i}", t, e) for i, (t, e) in enumerate(out)]

    @cached_property
    def _train(self) -> list[Sample]:
        return self._samples("train", self.cfg.train_questions)

    @cached_property
    def _heldout(self) -> list[Sample]:
        return self._samples("heldout", self.cfg.heldout_questions)

    def train_samples(self) -> list[Sample]:
        """``cfg.train_questions`` samples; combinations repeat (new uid, new distractors)."""
        return list(self._train)

    def heldout_samples(self) -> list[Sample]:
        """``cfg.heldout_questions`` samples over combinations disjoint from train."""
        return list(self._heldout)

    def vocabulary(self) -> list[str]:
        """Every word any prompt, action or observation can contain, in a fixed order."""
        words = list(MARKUP + INFO_WORDS + RELATIONS)
        for _, _, text in TEMPLATES:
            words += [w for w in text.split() if w != "{e}"]
        for ents in self.kb.entities.values():
            words += ents
        return list(dict.fromkeys(words))


def parse_action(action_text: str) -> tuple[str, str | None]:
    """``("search"|"answer", entity)`` for a well-formed action, else ``("invalid", None)``."""
    words = action_text.split()
    for role in ("search", "answer"):
        if len(words) == 3 and words[0] == f"<{role}>" and words[2] == f"</{role}>":
            return role, words[1]
    return "invalid", None


def _fact_text(facts: Sequence[Fact]) -> str:
    return " ".join(f"{s} {r} {o} ." for s, r, o in facts)


class MultihopEnv:
    """The AgentEnv over a :class:`MultihopTask`: search entities, then answer one."""

    stop_sequences: tuple[str, ...] = ("</search>", "</answer>")

    def __init__(self, task: MultihopTask) -> None:
        self.task = task
        self.cfg = task.cfg
        self._subjects = tuple(task.kb.facts)

    def reset(self, sample: Sample) -> tuple[str, EpisodeState]:
        """Prompt ``<question> WORDS ? </question> `` and the initial state."""
        return f"<question> {sample.question} </question> ", EpisodeState(sample)

    def search(self, state: EpisodeState, entity: str) -> str:
        """``<info> FACTS </info>``: the entity's facts plus distractors, in a seeded order.

        The order and distractors depend only on (seed, sample uid, turn, entity), so the same
        branch always sees the same observation.
        """
        facts = self.task.kb.facts.get(entity)
        if facts is None:
            return " <info> none </info> "
        key = f"{self.cfg.seed}|{state.sample.uid}|{state.turn}|{entity}".encode()
        rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big"))
        others = rng.sample([e for e in self._subjects if e != entity], self.cfg.distractors)
        shown = list(facts) + [rng.choice(self.task.kb.facts[e]) for e in others]
        rng.shuffle(shown)
        return f" <info> {_fact_text(shown)} </info> "

    def step(self, state: EpisodeState, action_text: str) -> StepResult:
        """Apply one action; the input state is left untouched (it is frozen).

        An answer ends the episode; so does the ``max_turns``-th action of any kind, without
        running its search (observation "", ``tool_call`` False, reward 0 without an answer).
        An invalid action costs a turn and marks the trajectory's format invalid.
        """
        if state.done:
            raise ValueError(f"step called on a finished episode (sample {state.sample.uid})")
        role, entity = parse_action(action_text)
        new = replace(state, turn=state.turn + 1, format_valid=state.format_valid and bool(entity))
        if role == "answer":
            return StepResult("", replace(new, answer=entity, done=True), True, role, False)
        if new.turn >= self.cfg.max_turns:
            return StepResult("", replace(new, done=True), True, role, False)
        if role == "invalid":
            return StepResult(" <info> invalid </info> ", new, False, role, False)
        return StepResult(self.search(state, entity or ""), new, False, role, True)

    def step_batch(
        self, states: Sequence[EpisodeState], action_texts: Sequence[str]
    ) -> list[StepResult]:
        """``step`` over many branches (the knowledge base is in memory, so one by one)."""
        if len(states) != len(action_texts):
            raise ValueError(f"{len(states)} states but {len(action_texts)} actions")
        return [self.step(s, a) for s, a in zip(states, action_texts, strict=True)]

    def reward(self, state: EpisodeState) -> float:
        """Format-aware exact match: 1.0 / 0.8 / 0.2 / 0.1, or 0.0 without an answer."""
        return format_aware_em(state.answer, state.sample.answers, state.format_valid)

    def success(self, state: EpisodeState) -> bool:
        """Whether the answer given is correct (exact match), whatever the format."""
        return state.answer is not None and exact_match(state.answer, state.sample.answers) == 1.0

    def vocabulary(self) -> list[str]:
        """Every word any prompt, action or observation can contain."""
        return self.task.vocabulary()

    def demonstration(self, sample: Sample, rng: random.Random, noise: float) -> list[str]:
        """Action texts of an expert trajectory; with probability ``noise`` one plausible mistake.

        Mistakes (one, uniformly among those that fit): search an entity seen in the last
        observation and then recover, skip the remaining hops by answering an intermediate entity,
        or answer with a wrong entity from the last observation.
        """
        meta = dict(sample.meta)
        path, hops = meta["path"], meta["hops"]
        kinds = ["wrong_answer"] + ["distractor_search"] * (hops + 2 <= self.cfg.max_turns)
        kind = rng.choice(kinds + ["skip_hop"] * (hops >= 2)) if rng.random() < noise else "none"
        at = rng.randint(1, hops - 1) if kind == "skip_hop" else rng.randint(1, hops)
        _, state = self.reset(sample)
        actions: list[str] = []
        seen: list[str] = []  # entities in the last observation

        def take(text: str) -> None:
            nonlocal state, seen
            actions.append(text)
            result = self.step(state, text)
            state = result.state
            seen = [w for w in result.observation.split() if w in self.task.kb.facts]

        for h in range(hops + 1):
            if kind == "distractor_search" and h == at:
                take(f"<search> {self._pick_other(rng, seen, path[h - 1 : h + 1])} </search>")
            if kind == "skip_hop" and h == at:
                take(f"<answer> {path[h]} </answer>")
                break
            if h == hops:
                wrong = kind == "wrong_answer"
                answer = self._pick_other(rng, seen, path[h:]) if wrong else path[h]
                take(f"<answer> {answer} </answer>")
                break
            take(f"<search> {path[h]} </search>")
        return actions

    def _pick_other(self, rng: random.Random, seen: Sequence[str], exclude: Sequence[str]) -> str:
        """A random entity of ``seen`` not in ``exclude`` (any other entity if there is none)."""
        pool = [e for e in dict.fromkeys(seen) if e not in exclude]
        return rng.choice(pool or [e for e in self._subjects if e not in exclude])
