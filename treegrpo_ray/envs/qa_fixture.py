"""A small synthetic retrieval-QA data set, built from a seed: no downloads, same files every time.

An encyclopedia of made-up entities, one passage each: 20 countries, 50 cities, 30 organisations and
100 persons (200 passages), every passage one sentence of facts, e.g. ::

    Brilowen Cozelgal | Brilowen Cozelgal is an architect who was born in the city of Morhes and
                        works for the Ulmqenta Brewery.
    Morhes            | Morhes is a city located in the country of Brinarmor, founded in the year 1893.

100 questions (60 single-hop, 40 two-hop) ask about those facts (80 train, 20 held out; up to 300
more held-out questions on request, ``build_fixture(heldout=...)``); the fact that answers a question
is in exactly one passage (``meta["gold_ids"]`` lists the passages to read, in hop order). Every
entity name is made of words no other entity uses, so a lexical retriever can find the passage.
``write_fixture`` writes ``corpus.jsonl``, ``train.parquet`` (Search-R1 columns) and ``test.jsonl``
(FlashRAG columns).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from treegrpo_ray.envs.base import Sample
from treegrpo_ray.envs.qa_data import Passage, write_corpus, write_flashrag, write_search_r1

SYLLABLES = (
    "ka", "lo", "mir", "ven", "ta", "ru", "sel", "dor", "an", "bri", "co", "fen", "gal", "hes",
    "ith", "jun", "kel", "lum", "nar", "ost", "pra", "quin", "ros", "sul", "tor", "ulm", "vay",
    "wen", "xan", "yor", "zel", "dus", "qen", "mor",
)  # fmt: skip
PROFESSIONS = ("painter", "sailor", "chemist", "poet", "architect", "astronomer", "weaver", "baker")
ORG_KINDS = ("Shipyard", "Observatory", "Guild", "Academy", "Brewery", "Library")
COUNTS = {"country": 20, "city": 50, "org": 30, "person": 100}
SINGLE_HOP, TWO_HOP, TEST_QUESTIONS = 60, 40, 20
# Held-out questions the fixture can draw: its 20 plus up to 300 more, well inside the 680
# (template, subject) pairs the 100 base questions leave (410 single-hop, 290 two-hop).
MAX_HELDOUT = 320
DATA_SOURCE = "fixture"

# name -> (subject kind, relations followed, question with {e}); relations read the facts below.
TEMPLATES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "birth_city": ("person", ("born_in",), "In which city was {e} born?"),
    "employer": ("person", ("works_for",), "Which organization does {e} work for?"),
    "profession": ("person", ("profession",), "What is the profession of {e}?"),
    "city_country": ("city", ("located_in",), "Which country is the city of {e} located in?"),
    "city_year": ("city", ("founded",), "In which year was the city of {e} founded?"),
    "org_city": ("org", ("based_in",), "In which city is the {e} headquartered?"),
    "capital": ("country", ("capital",), "What is the capital of {e}?"),
    "birth_country": ("person", ("born_in", "located_in"), "In which country was {e} born?"),
    "employer_city": (
        "person",
        ("works_for", "based_in"),
        "In which city is the organization that {e} works for headquartered?",
    ),
    "org_country": ("org", ("based_in", "located_in"), "In which country is the {e} based?"),
    "birth_year": (
        "person",
        ("born_in", "founded"),
        "In which year was the city where {e} was born founded?",
    ),
}


@dataclass(frozen=True)
class QAFixture:
    """The corpus (passage ids ``doc-0`` ...), the train questions and the test questions."""

    passages: tuple[Passage, ...]
    train: tuple[Sample, ...]
    test: tuple[Sample, ...]


def _names(rng: random.Random, count: int, used: set[str]) -> list[str]:
    """``count`` new capitalised words of 2-3 syllables, none in ``used`` (which grows)."""
    out: list[str] = []
    while len(out) < count:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if len(word) >= 5 and word.lower() not in used:
            used.add(word.lower())
            out.append(word)
    return out


def _facts(rng: random.Random) -> dict[str, dict[str, str]]:
    """Entity name -> {relation: object name, "kind": kind}, for every entity."""
    used: set[str] = set()
    countries = _names(rng, COUNTS["country"], used)
    cities = _names(rng, COUNTS["city"], used)
    orgs = [f"{w} {rng.choice(ORG_KINDS)}" for w in _names(rng, COUNTS["org"], used)]
    first, last = _names(rng, COUNTS["person"], used), _names(rng, COUNTS["person"], used)
    facts: dict[str, dict[str, str]] = {}
    capitals = rng.sample(cities, len(countries))
    for country, city in zip(countries, capitals, strict=True):
        facts[country] = {"kind": "country", "capital": city}
    for city in cities:
        home = countries[capitals.index(city)] if city in capitals else rng.choice(countries)
        facts[city] = {"kind": "city", "located_in": home, "founded": str(rng.randint(1100, 1900))}
    for org in orgs:
        facts[org] = {"kind": "org", "based_in": rng.choice(cities)}
    for name in (f"{a} {b}" for a, b in zip(first, last, strict=True)):
        facts[name] = {
            "kind": "person",
            "profession": rng.choice(PROFESSIONS),
            "born_in": rng.choice(cities),
            "works_for": rng.choice(orgs),
        }
    return facts


def _sentence(name: str, f: dict[str, str]) -> str:
    kind = f["kind"]
    if kind == "country":
        return f"{name} is a country whose capital is the city of {f['capital']}."
    if kind == "city":
        return (
            f"{name} is a city located in the country of {f['located_in']}, "
            f"founded in the year {f['founded']}."
        )
    if kind == "org":
        return f"The {name} is an institution headquartered in the city of {f['based_in']}."
    article = "an" if f["profession"][0] in "aeiou" else "a"
    return (
        f"{name} is {article} {f['profession']} who was born in the city of {f['born_in']} "
        f"and works for the {f['works_for']}."
    )


def _questions(
    rng: random.Random,
    facts: dict[str, dict[str, str]],
    ids: dict[str, str],
    seen: set[tuple[str, str]],
    counts: tuple[int, int],
    first_id: int = 0,
) -> list[Sample]:
    """``counts`` = (single-hop, two-hop) questions, no (template, subject) pair in ``seen`` (which
    grows) and no two-hop question whose first passage names its answer, shuffled; ids
    ``fixture-{first_id}`` on."""
    by_kind: dict[str, list[str]] = {}
    for name, f in facts.items():
        by_kind.setdefault(f["kind"], []).append(name)
    samples: list[Sample] = []
    for hops, count in zip((1, 2), counts, strict=True):
        names = [t for t, (_, rels, _) in TEMPLATES.items() if len(rels) == hops]
        made = 0
        while made < count:
            template = rng.choice(names)
            kind, relations, text = TEMPLATES[template]
            subject = rng.choice(by_kind[kind])
            if (template, subject) in seen:
                continue
            seen.add((template, subject))
            path = [subject]
            for rel in relations:
                path.append(facts[path[-1]][rel])
            if any(path[-1] in _sentence(e, facts[e]) for e in path[:-2]):
                continue  # the first hop's passage already names the answer: no second hop needed
            meta = (
                ("data_source", DATA_SOURCE),
                ("template", template),
                ("hops", hops),
                ("gold_ids", tuple(ids[e] for e in path[:-1])),
            )
            question = text.format(e=subject)
            samples.append(
                Sample(f"fixture-{first_id + len(samples)}", question, (path[-1],), meta)
            )
            made += 1
    rng.shuffle(samples)
    return samples


def extra_counts(extra: int) -> tuple[int, int]:
    """(single-hop, two-hop) of ``extra`` more held-out questions, in the base set's 60:40 mix."""
    two_hop = round(extra * TWO_HOP / (SINGLE_HOP + TWO_HOP))
    return extra - two_hop, two_hop


def build_fixture(seed: int = 0, heldout: int = TEST_QUESTIONS) -> QAFixture:
    """The fixture of ``seed``: 200 passages, 80 train and ``heldout`` test questions.

    The first 20 test questions and the train questions do not depend on ``heldout``; beyond 20,
    more test questions are drawn after them from the same generator (60:40 single-hop to two-hop,
    no (template, subject) pair of any other question), at most ``MAX_HELDOUT``."""
    if not TEST_QUESTIONS <= heldout <= MAX_HELDOUT:
        raise ValueError(
            f"the QA fixture has {TEST_QUESTIONS} to {MAX_HELDOUT} held-out questions, not "
            f"{heldout}; set task.search_qa.fixture_heldout in that range"
        )
    rng = random.Random(f"qa-fixture-{seed}")
    facts = _facts(rng)
    ids = {name: f"doc-{i}" for i, name in enumerate(facts)}
    passages = tuple(Passage(ids[n], n, _sentence(n, f)) for n, f in facts.items())
    seen: set[tuple[str, str]] = set()
    samples = _questions(rng, facts, ids, seen, (SINGLE_HOP, TWO_HOP))
    extra = _questions(
        rng, facts, ids, seen, extra_counts(heldout - TEST_QUESTIONS), first_id=len(samples)
    )
    test = samples[:TEST_QUESTIONS] + extra
    return QAFixture(passages, tuple(samples[TEST_QUESTIONS:]), tuple(test))


def write_fixture(directory: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``corpus.jsonl``, ``train.parquet`` and ``test.jsonl`` into ``directory``; returns
    their paths by name (``corpus``, ``train``, ``test``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fixture = build_fixture(seed)
    paths = {
        "corpus": directory / "corpus.jsonl",
        "train": directory / "train.parquet",
        "test": directory / "test.jsonl",
    }
    write_corpus(paths["corpus"], fixture.passages)
    write_search_r1(paths["train"], fixture.train, split="train")
    write_flashrag(paths["test"], fixture.test)
    return paths
