"""Search-R1 parquet / FlashRAG jsonl / corpus loaders and the synthetic fixture's files."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from treegrpo_ray.envs.base import Sample
from treegrpo_ray.envs.qa_data import (
    Passage,
    load_corpus,
    load_samples,
    search_r1_prompt,
    search_r1_row,
)
from treegrpo_ray.envs.qa_fixture import build_fixture, write_fixture
from treegrpo_ray.errors import UserInputError


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("qa"), seed=0)


def write_lines(path, lines):
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_fixture_is_deterministic_and_sized():
    fixture = build_fixture(0)
    assert fixture == build_fixture(0) and fixture != build_fixture(1)
    assert (len(fixture.passages), len(fixture.train), len(fixture.test)) == (200, 80, 20)
    questions = fixture.train + fixture.test
    hops = [dict(s.meta)["hops"] for s in questions]
    assert (hops.count(1), hops.count(2)) == (60, 40)
    assert len({s.uid for s in questions}) == 100
    assert len({p.id for p in fixture.passages}) == 200


def test_a_larger_heldout_split_extends_the_base_one():
    base, large = build_fixture(0), build_fixture(0, heldout=200)
    assert large.passages == base.passages and large.train == base.train
    assert large.test[:20] == base.test and len(large.test) == 200
    pairs = {(dict(s.meta)["template"], s.question) for s in large.train + large.test}
    assert len(pairs) == 280  # no question twice, none a train question
    assert len({s.uid for s in large.train + large.test}) == 280
    extra_hops = [dict(s.meta)["hops"] for s in large.test[20:]]
    assert (extra_hops.count(1), extra_hops.count(2)) == (108, 72)
    with pytest.raises(ValueError, match="fixture_heldout"):
        build_fixture(0, heldout=321)


def test_every_fixture_answer_is_stated_in_its_last_gold_passage():
    fixture = build_fixture(0, heldout=320)
    text = {p.id: p.text for p in fixture.passages}
    for sample in fixture.train + fixture.test:
        gold = dict(sample.meta)["gold_ids"]
        assert len(gold) == dict(sample.meta)["hops"]
        assert sample.answers[0] in text[gold[-1]]
        assert not any(sample.answers[0] in text[g] for g in gold[:-1])


def test_fixture_files_round_trip(fixture_files):
    fixture = build_fixture(0)
    assert load_corpus(fixture_files["corpus"]) == list(fixture.passages)
    assert load_samples(fixture_files["test"]) == list(fixture.test)  # FlashRAG keeps metadata
    train = load_samples(fixture_files["train"])  # Search-R1 rows keep data_source only
    assert [(s.uid, s.question, s.answers) for s in train] == [
        (s.uid, s.question, s.answers) for s in fixture.train
    ]
    assert {s.meta for s in train} == {(("data_source", "fixture"),)}
    assert len(load_samples(fixture_files["train"], limit=7)) == 7


def test_search_r1_rows_with_prompt_and_ground_truth_only(tmp_path):
    # The parquet of nq_search.py without its question / golden_answers columns.
    frame = pd.DataFrame(
        {
            "data_source": ["nq", "hotpotqa"],
            "prompt": [
                [{"role": "user", "content": search_r1_prompt("who wrote hamlet?")}],
                [{"role": "user", "content": search_r1_prompt("capital of France?")}],
            ],
            "reward_model": [
                {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
                {"style": "rule", "ground_truth": {"target": ["Paris", "paris"]}},
            ],
        }
    )
    frame.to_parquet(tmp_path / "train.parquet")
    assert load_samples(tmp_path / "train.parquet") == [
        Sample("row1", "who wrote hamlet?", ("Shakespeare",), (("data_source", "nq"),)),
        Sample("row2", "capital of France?", ("Paris", "paris"), (("data_source", "hotpotqa"),)),
    ]


def test_search_r1_row_accepts_numpy_answers():
    row = {"id": "train_3", "question": " q? ", "golden_answers": np.array(["a", "b"])}
    assert search_r1_row(row, 4) == Sample(
        "train_3", "q?", ("a", "b"), (("data_source", "unknown"),)
    )


def test_malformed_jsonl_rows_are_skipped_with_one_warning(tmp_path):
    (tmp_path / "nq").mkdir()
    path = write_lines(
        tmp_path / "nq" / "test.jsonl",
        [
            json.dumps({"id": "a", "question": "q1?", "golden_answers": ["x"]}),
            "{not json",
            json.dumps({"id": "b", "golden_answers": ["x"]}),
            json.dumps({"id": "c", "question": "q3?", "golden_answers": []}),
            json.dumps({"id": "d", "question": "q4?", "golden_answers": "Paris"}),
            "",
            json.dumps({"id": "e", "question": "q6?", "golden_answers": [1984, " y "]}),
        ],
    )
    with pytest.warns(UserWarning) as record:
        samples = load_samples(path)
    assert len(record) == 1
    assert str(record[0].message) == (
        f"{path}: skipped 4 malformed rows of 6 (row 2: not valid JSON; row 3: missing or empty "
        "question; row 4: no answers (golden_answers is empty); row 5: golden_answers must be a "
        "list of strings, got str)"
    )
    # FlashRAG rows without metadata.data_source take the directory's name (nq/test.jsonl).
    assert samples == [
        Sample("a", "q1?", ("x",), (("data_source", "nq"),)),
        Sample("e", "q6?", ("1984", "y"), (("data_source", "nq"),)),
    ]


def test_the_warning_shows_five_problems_and_counts_the_rest(tmp_path):
    rows = ['{"question": "ok?", "golden_answers": ["y"]}'] + ["[]"] * 7
    with pytest.warns(
        UserWarning, match=r"skipped 7 malformed rows of 8 \(row 2: a row must be a "
    ):
        load_samples(write_lines(tmp_path / "d.jsonl", rows))
    with pytest.warns(
        UserWarning, match=r"row 6: a row must be a JSON object, got list; and 2 more\)$"
    ):
        load_samples(write_lines(tmp_path / "d.jsonl", rows))


def test_malformed_parquet_rows_name_their_row(tmp_path):
    frame = pd.DataFrame(
        {
            "id": ["x0", "x1", "x2"],
            "question": ["fine?", None, "no answers?"],
            "golden_answers": [["a"], ["b"], []],
            "data_source": ["nq", "nq", "nq"],
        }
    )
    frame.to_parquet(tmp_path / "t.parquet")
    with pytest.warns(UserWarning, match="row 2: missing question .*; row 3: no answers"):
        samples = load_samples(tmp_path / "t.parquet")
    assert [s.uid for s in samples] == ["x0"]


def test_unusable_files_raise_user_input_errors(tmp_path):
    with pytest.raises(UserInputError, match=r"data file .*missing.jsonl does not exist"):
        load_samples(tmp_path / "missing.jsonl")
    with pytest.raises(UserInputError, match=r"unknown file type '.csv'"):
        load_samples(tmp_path / "train.csv")
    bad = write_lines(tmp_path / "bad.jsonl", ["nope", '{"question": "q"}'])
    with pytest.raises(UserInputError, match=r"bad.jsonl holds no usable questions \(row 1: not"):
        load_samples(bad)
    (tmp_path / "garbage.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(UserInputError, match="cannot read parquet file .*garbage.parquet"):
        load_samples(tmp_path / "garbage.parquet")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserInputError, match="the file is empty"):
        load_samples(tmp_path / "empty.jsonl")


def test_json_list_files_duplicate_ids_and_metadata(tmp_path):
    rows = [
        {"id": "train_0", "question": "a?", "golden_answers": ["1"], "metadata": {"type": "b"}},
        {"id": "train_0", "question": "b?", "golden_answers": ["2"], "metadata": {"ctx": {"x": 1}}},
    ]
    (tmp_path / "merged.json").write_text(json.dumps(rows))
    samples = load_samples(tmp_path / "merged.json")
    assert [s.uid for s in samples] == ["train_0", "train_0#1"]  # merged sets reuse ids
    source = tmp_path.name
    assert samples[0].meta == (("data_source", source), ("type", "b"))
    assert samples[1].meta == (("data_source", source),)  # nested metadata is left out


def test_corpus_rows_title_on_the_first_line(tmp_path):
    path = write_lines(
        tmp_path / "wiki.jsonl",
        [
            json.dumps({"id": "0", "contents": '"Aaron"\nAaron is a prophet.'}),
            json.dumps({"id": "1", "contents": "No title line here."}),
            json.dumps({"id": "2", "title": "T", "text": "plain text "}),
            json.dumps({"id": "3"}),
        ],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        passages = load_corpus(path)
    assert passages == [
        Passage("0", "Aaron", "Aaron is a prophet."),
        Passage("1", "", "No title line here."),
        Passage("2", "T", "plain text"),
    ]
    assert [str(w.message) for w in caught] == [
        f"{path}: skipped 1 malformed rows of 4 (row 4: no 'contents' (or 'text') string)"
    ]
