"""The BM25 retriever: hand-computed scores, deterministic ties, batching, the fixture's recall,
the index cache, and the dense option's errors."""

from __future__ import annotations

import math
import sys
import types

import pytest

from treegrpo_ray.actors.retriever import Retriever
from treegrpo_ray.envs.qa_data import Passage
from treegrpo_ray.envs.qa_fixture import build_fixture, write_fixture
from treegrpo_ray.envs.search_qa import SearchQAConfig
from treegrpo_ray.errors import UserInputError

SMALL = [
    Passage("a", "", "apple banana"),
    Passage("b", "", "apple cherry cherry"),
    Passage("c", "", "durian"),
]


@pytest.fixture(scope="module")
def fixture_retriever():
    fixture = build_fixture(0)
    return fixture, Retriever.from_corpus(fixture.passages)


def test_bm25_scores_match_the_lucene_formula():
    retriever = Retriever.from_corpus(SMALL)
    # N = 3 documents, lengths 2, 3, 1 -> avgdl = 2; k1 = 1.5, b = 0.75.
    # "cherry": df = 1, idf = ln(1 + (3 - 1 + 0.5) / (1 + 0.5)) = ln(8/3) = 0.980829;
    #   doc b: tf = 2, dl = 3: 2 / (2 + 1.5 * (0.25 + 0.75 * 3/2)) = 2 / 4.0625 = 0.492308.
    # "apple": df = 2, idf = ln(1 + 1.5 / 2.5) = ln(1.6) = 0.470004;
    #   doc a: tf = 1, dl = 2: 1 / (1 + 1.5) = 0.4; doc b: 1 / (1 + 1.5 * 1.375) = 0.326531.
    [[cherry], [apple_a, apple_b], [both_b, both_a]] = retriever.search_batch(
        ["cherry", "the apple", "apple cherry"], k=3
    )
    assert cherry.id == "b" and cherry.score == pytest.approx(math.log(8 / 3) * 2 / 4.0625, 1e-6)
    assert (apple_a.id, apple_b.id) == ("a", "b")
    assert apple_a.score == pytest.approx(math.log(1.6) * 0.4, 1e-6)
    assert apple_b.score == pytest.approx(math.log(1.6) / 3.0625, 1e-6)
    assert both_b.id == "b" and both_b.score == pytest.approx(cherry.score + apple_b.score, 1e-6)
    assert (both_a.id, both_a.text) == ("a", "apple banana")


def test_ties_follow_corpus_order_and_misses_return_nothing():
    twins = [Passage(str(i), "", "same words here") for i in range(5)]
    retriever = Retriever.from_corpus(twins)
    hits = retriever.search_batch(["words"], k=3)[0]
    assert [p.id for p in hits] == ["0", "1", "2"]
    assert len({p.score for p in hits}) == 1
    assert retriever.search_batch(["zebra", "", "the of and"], k=3) == [[], [], []]
    assert retriever.search_batch([], k=3) == []
    with pytest.raises(ValueError, match="k must be >= 1"):
        retriever.search_batch(["words"], k=0)


def test_a_batch_equals_its_queries_one_by_one(fixture_retriever):
    fixture, retriever = fixture_retriever
    queries = [s.question for s in fixture.test]
    batched = retriever.search_batch(queries, k=3)
    assert batched == [retriever.search_batch([q], k=3)[0] for q in queries]
    assert retriever.search_batch(queries, k=3) == batched  # repeatable


def test_bm25_finds_the_gold_passage_of_fixture_questions(fixture_retriever):
    fixture, retriever = fixture_retriever
    questions = fixture.train + fixture.test
    single = [s for s in questions if dict(s.meta)["hops"] == 1]
    double = [s for s in questions if dict(s.meta)["hops"] == 2]
    top1 = [hits[0].id for hits in retriever.search_batch([s.question for s in single], k=3)]
    # Measured on seed 0: every single-hop question ranks its gold passage first (60 of 60).
    assert (
        sum(hit == dict(s.meta)["gold_ids"][0] for hit, s in zip(top1, single, strict=True)) == 60
    )
    # Two-hop questions: the question finds the first hop, the bridge entity's name the second.
    first = retriever.search_batch([s.question for s in double], k=3)
    assert all(
        dict(s.meta)["gold_ids"][0] in [p.id for p in hits]
        for s, hits in zip(double, first, strict=True)
    )
    titles = {p.id: p.title for p in fixture.passages}
    bridges = [titles[dict(s.meta)["gold_ids"][1]] for s in double]
    second = retriever.search_batch(bridges, k=3)
    assert [hits[0].id for hits in second] == [dict(s.meta)["gold_ids"][1] for s in double]


def test_from_config_reads_the_fixture_or_a_corpus_file(tmp_path):
    assert Retriever.from_config(SearchQAConfig(fixture=True)).num_passages() == 200
    paths = write_fixture(tmp_path)
    from_file = Retriever.from_config(SearchQAConfig(corpus_path=str(paths["corpus"])))
    assert from_file.passages == list(build_fixture(0).passages)
    with pytest.raises(UserInputError, match="corpus_path is not set"):
        Retriever.from_config(SearchQAConfig())


def test_the_bm25_index_is_cached_in_index_path(tmp_path):
    index = tmp_path / "bm25"
    built = Retriever.from_corpus(SMALL, index_path=str(index))
    assert (index / "params.index.json").is_file()
    loaded = Retriever.from_corpus(SMALL, index_path=str(index))
    assert loaded.search_batch(["apple cherry"], 3) == built.search_batch(["apple cherry"], 3)
    with pytest.raises(UserInputError, match="holds 3 passages but the corpus has 2"):
        Retriever.from_corpus(SMALL[:2], index_path=str(index))


def test_dense_says_which_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import fails
    with pytest.raises(
        UserInputError,
        match=r"needs the 'sentence-transformers' package.*"
        r"pip install 'treegrpo-ray\[dense\]'",
    ):
        Retriever.from_corpus(SMALL, "dense", dense_model="/models/e5-base-v2")
    monkeypatch.setitem(sys.modules, "sentence_transformers", types.ModuleType("st"))
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(UserInputError, match="needs the 'faiss-cpu' package"):
        Retriever.from_corpus(SMALL, "dense", dense_model="/models/e5-base-v2")
    with pytest.raises(UserInputError, match="needs search_qa.dense_model"):
        Retriever.from_corpus(SMALL, "dense")
