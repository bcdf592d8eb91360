"""Loaders for retrieval-QA data: Search-R1 parquet, FlashRAG jsonl and wiki-style corpora.

Question files (``load_samples``, format chosen by the extension):

- ``.parquet``: Search-R1 rows (``scripts/data_process/nq_search.py`` and the NQ + HotpotQA merge):
  ``question`` (or ``prompt``, a chat list whose content ends with ``Question: ...``),
  ``golden_answers`` (or ``reward_model.ground_truth.target``), ``data_source``, optional ``id``.
- ``.jsonl`` / ``.json``: FlashRAG rows ``{"id", "question", "golden_answers": [...], "metadata"}``
  (one object per line, or a ``.json`` file holding one list of such objects).

Corpus files (``load_corpus``): one ``{"id", "contents": "\\"Title\\"\\ntext"}`` object per line (the
title is the first line of ``contents``), or ``{"id", "title", "text"}``.

Malformed rows are skipped and counted: one warning per file says how many, and where and why for
the first few. A missing or unreadable file, or one without a single usable row, is a
``UserInputError``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from treegrpo_ray.envs.base import Sample
from treegrpo_ray.errors import UserInputError

QUESTION_MARKER = "Question:"
SHOWN_PROBLEMS = 5  # malformed rows described one by one in the warning
QUESTION_SUFFIXES = (".parquet", ".jsonl", ".json")

INSTRUCTION = (
    "Answer the given question. Think step by step inside <think> and </think> every time you get "
    "new information. If some knowledge is missing, call the search engine with "
    "<search> query </search>; its top results come back between <information> and "
    "</information>. You can search several times. Once you know the answer, give it inside "
    "<answer> and </answer> with no explanation, for example <answer> Paris </answer>. "
)


@dataclass(frozen=True)
class Passage:
    """One retrievable passage: corpus ``id``, ``title``, ``text``; ``score`` from the retriever."""

    id: str
    title: str
    text: str
    score: float = 0.0


class RowError(ValueError):
    """A malformed row; the message says why."""


def search_r1_prompt(question: str) -> str:
    """The Search-R1 style prompt text for ``question`` (instruction, then ``Question: ...``)."""
    return f"{INSTRUCTION}{QUESTION_MARKER} {question}\n"


def question_from_prompt(content: str) -> str:
    """The question of a Search-R1 prompt: the text after its last ``Question:``."""
    if QUESTION_MARKER not in content:
        raise RowError(f"prompt content has no '{QUESTION_MARKER}'")
    return content.rsplit(QUESTION_MARKER, 1)[1].strip()


def _answers(value: Any) -> tuple[str, ...]:
    """Gold answers from a list / tuple / numpy array of strings (numbers are written out)."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()  # numpy arrays from pandas
    if not isinstance(value, list | tuple):
        raise RowError(f"golden_answers must be a list of strings, got {type(value).__name__}")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise RowError(f"golden_answers holds a {type(item).__name__}, not a string")
        if str(item).strip():
            out.append(str(item).strip())
    if not out:
        raise RowError("no answers (golden_answers is empty)")
    return tuple(out)


def _question(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RowError("missing or empty question")
    return value.strip()


def search_r1_row(row: dict[str, Any], row_number: int) -> Sample:
    """A ``Sample`` from one Search-R1 parquet row (see the module docstring for the columns)."""
    if isinstance(row.get("question"), str):
        question = _question(row["question"])
    elif row.get("prompt") is not None:
        messages = row["prompt"]
        messages = messages.tolist() if hasattr(messages, "tolist") else messages
        if not messages or not isinstance(messages[-1], dict):
            raise RowError("prompt is not a list of chat messages")
        question = _question(question_from_prompt(str(messages[-1].get("content", ""))))
    else:
        raise RowError("missing question (no 'question' or 'prompt' column value)")
    if row.get("golden_answers") is not None:
        answers = _answers(row["golden_answers"])
    else:
        model = row.get("reward_model")
        truth = model.get("ground_truth") if isinstance(model, dict) else None
        answers = _answers(truth.get("target") if isinstance(truth, dict) else None)
    source = str(row.get("data_source") or "unknown")
    uid = str(row["id"]) if row.get("id") is not None else f"row{row_number}"
    return Sample(uid=uid, question=question, answers=answers, meta=(("data_source", source),))


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


def flashrag_row(row: Any, row_number: int, default_source: str) -> Sample:
    """A ``Sample`` from one FlashRAG row.

    ``meta`` gets ``data_source`` and the ``metadata`` entries that are scalars or lists of scalars
    (as tuples); bulky nested ones (HotpotQA's contexts) are left out, as samples travel in leases.
    """
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    question = _question(row.get("question"))
    answers = _answers(row.get("golden_answers"))
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise RowError("metadata must be an object")
    meta: dict[str, Any] = {"data_source": default_source}
    for key, value in metadata.items():
        if isinstance(value, list) and all(_scalar(v) for v in value):
            meta[key] = tuple(value)
        elif _scalar(value):
            meta[key] = value
    uid = str(row["id"]) if row.get("id") is not None else f"row{row_number}"
    return Sample(uid=uid, question=question, answers=answers, meta=tuple(meta.items()))


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(row number, parsed row or RowError)`` of a jsonl file (1-based lines, blank skipped) or
    of a ``.json`` file holding one list."""
    text = _read_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserInputError(f"{path} is not valid JSON ({err}); fix or regenerate it") from err
        yield from enumerate(rows, start=1)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError:
            yield number, RowError("not valid JSON")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserInputError(
            f"cannot read {path} ({err.__class__.__name__}: {err}); check the path in the "
            "search_qa section of the config"
        ) from err


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as err:
        raise UserInputError(
            f"cannot read parquet file {path} ({err}); check the path in the search_qa section "
            "of the config (a Search-R1 file from scripts/data_process/*.py)"
        ) from err
    yield from enumerate(table.to_pylist(), start=1)


def _collect(
    path: Path, rows: Iterator[tuple[int, Any]], parse: Callable[[Any, int], Any], what: str
) -> list[Any]:
    """Parse every row, skipping malformed ones with one warning; none usable raises."""
    out, problems = [], []
    for number, row in rows:
        try:
            if isinstance(row, RowError):
                raise row
            out.append(parse(row, number))
        except RowError as err:
            problems.append(f"row {number}: {err}")
    if not out:
        detail = "; ".join(problems[:SHOWN_PROBLEMS]) or "the file is empty"
        raise UserInputError(
            f"{path} holds no usable {what} ({detail}); point the config at a file in the format "
            "described in docs/search_qa.md"
        )
    if problems:
        shown = "; ".join(problems[:SHOWN_PROBLEMS])
        more = (
            f"; and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        )
        warnings.warn(
            f"{path}: skipped {len(problems)} malformed rows of {len(out) + len(problems)} "
            f"({shown}{more})",
            stacklevel=3,
        )
    return out


def _existing(path: str | Path, suffixes: Sequence[str]) -> Path:
    path = Path(path).expanduser()
    if path.suffix not in suffixes:
        raise UserInputError(
            f"{path}: unknown file type '{path.suffix}'; use one of {', '.join(suffixes)}"
        )
    if not path.is_file():
        raise UserInputError(
            f"data file {path} does not exist; download or generate it (docs/search_qa.md) and "
            "set its path in the search_qa section of the config"
        )
    return path


def _unique_uids(samples: list[Sample]) -> list[Sample]:
    """Suffix repeated uids (merged datasets reuse ids such as ``train_0``) with ``#n``."""
    seen: dict[str, int] = {}
    out = []
    for sample in samples:
        count = seen.get(sample.uid, 0)
        seen[sample.uid] = count + 1
        if count:
            sample = Sample(f"{sample.uid}#{count}", sample.question, sample.answers, sample.meta)
        out.append(sample)
    return out


def load_samples(path: str | Path, limit: int | None = None) -> list[Sample]:
    """Questions of a Search-R1 ``.parquet`` or FlashRAG ``.jsonl``/``.json`` file, in file order.

    ``limit`` keeps the first ``limit`` usable rows. FlashRAG rows without
    ``metadata.data_source`` get the name of the file's directory (FlashRAG's layout ``nq/test.jsonl``).
    """
    path = _existing(path, QUESTION_SUFFIXES)
    if path.suffix == ".parquet":
        samples = _collect(path, _parquet_rows(path), search_r1_row, "questions")
    else:
        source = path.parent.name or "unknown"
        parse = partial(flashrag_row, default_source=source)
        samples = _collect(path, _json_rows(path), parse, "questions")
    return _unique_uids(samples)[:limit]


def corpus_row(row: Any, row_number: int) -> Passage:
    """A ``Passage`` from ``{"id", "contents"}`` (title on the first line, quotes stripped) or
    ``{"id", "title", "text"}``."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    pid = str(row["id"]) if row.get("id") is not None else str(row_number - 1)
    if isinstance(row.get("contents"), str):
        title, _, text = row["contents"].partition("\n")
        title = title.strip().strip('"')
        if not text.strip():  # no title line: all of it is text
            title, text = "", row["contents"]
        return Passage(pid, title, text.strip())
    if isinstance(row.get("text"), str):
        return Passage(pid, str(row.get("title") or ""), row["text"].strip())
    raise RowError("no 'contents' (or 'text') string")


def load_corpus(path: str | Path) -> list[Passage]:
    """Every passage of a corpus jsonl file, in file order (the retriever's index order)."""
    path = _existing(path, (".jsonl",))
    return _collect(path, _json_rows(path), corpus_row, "passages")


def write_corpus(path: str | Path, passages: Sequence[Passage]) -> None:
    """Write passages as a FlashRAG / Search-R1 corpus jsonl (``contents = '"Title"\\ntext'``)."""
    lines = (
        json.dumps({"id": p.id, "contents": f'"{p.title}"\n{p.text}'}, ensure_ascii=False)
        for p in passages
    )
    Path(path).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def write_flashrag(path: str | Path, samples: Sequence[Sample]) -> None:
    """Write samples as FlashRAG jsonl rows; ``meta`` becomes ``metadata``."""
    rows = (
        {
            "id": s.uid,
            "question": s.question,
            "golden_answers": list(s.answers),
            "metadata": {k: list(v) if isinstance(v, tuple) else v for k, v in s.meta},
        }
        for s in samples
    )
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    Path(path).write_text(text, encoding="utf-8")


def write_search_r1(path: str | Path, samples: Sequence[Sample], split: str) -> None:
    """Write samples as a Search-R1 parquet file (the columns of ``nq_search.py``'s output)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for index, s in enumerate(samples):
        rows.append(
            {
                "id": s.uid,
                "question": s.question,
                "golden_answers": list(s.answers),
                "data_source": str(dict(s.meta).get("data_source", "unknown")),
                "prompt": [{"role": "user", "content": search_r1_prompt(s.question)}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": list(s.answers)}},
                "extra_info": {"split": split, "index": index},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
