"""The search tool of the retrieval-QA environment: BM25 (default) or dense retrieval over a corpus.

A plain class: the environment calls ``search_batch`` in-process, or ``cluster/retriever.py`` runs
it as one Ray actor that serves every rollout worker. One call answers many queries (every branch
of a wave of tree expansions), which is where batching pays: the dense encoder embeds the queries
together, and the actor is one round trip per wave instead of one per branch.

- ``bm25``: the ``bm25s`` library, lower-cased ``\\w\\w+`` tokens without English stop words and
  no stemming, over ``title + text``. Ties are broken by corpus order, so results are repeatable.
  Passages that share no term with the query are never returned (fewer than ``k`` is possible).
- ``dense``: ``sentence-transformers`` + ``faiss`` (the ``dense`` extra), e5 conventions (``query:``
  / ``passage:`` prefixes, normalised embeddings, inner product), a prebuilt faiss index or one
  built in memory from the corpus.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from treegrpo_ray.envs.qa_data import Passage, load_corpus
from treegrpo_ray.envs.qa_fixture import build_fixture
from treegrpo_ray.envs.search_qa import SearchQAConfig
from treegrpo_ray.errors import UserInputError

QUERY_PREFIX, PASSAGE_PREFIX = "query: ", "passage: "  # e5's training format
Hit = tuple[int, float]  # (corpus index, score)


def _top_k(scores: np.ndarray, k: int) -> list[Hit]:
    """The ``k`` best positive scores, highest first, equal scores in corpus order."""
    candidates = np.flatnonzero(scores > 0)
    if len(candidates) > k:
        kth = np.partition(scores[candidates], -k)[-k]
        candidates = candidates[scores[candidates] >= kth]
    order = np.lexsort((candidates, -scores[candidates]))[:k]
    return [(int(candidates[i]), float(scores[candidates[i]])) for i in order]


class BM25Index:
    """bm25s over the texts; ``index_dir`` caches the index (loaded if present, else saved)."""

    def __init__(self, texts: Sequence[str], index_dir: str | None = None):
        import bm25s

        self._bm25s = bm25s
        cached = index_dir is not None and (Path(index_dir) / "params.index.json").is_file()
        if cached:
            self.model = bm25s.BM25.load(index_dir)
            if self.model.scores["num_docs"] != len(texts):
                raise UserInputError(
                    f"the BM25 index in {index_dir} holds {self.model.scores['num_docs']} "
                    f"passages but the corpus has {len(texts)}; delete {index_dir} to rebuild it"
                )
            return
        self.model = bm25s.BM25()
        tokens = bm25s.tokenize(list(texts), stopwords="en", show_progress=False)
        self.model.index(tokens, show_progress=False)
        if index_dir is not None:
            Path(index_dir).mkdir(parents=True, exist_ok=True)
            self.model.save(index_dir)

    def top_k(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        tokens = self._bm25s.tokenize(
            list(queries), stopwords="en", return_ids=False, show_progress=False
        )
        return [_top_k(self.model.get_scores(t), k) if t else [] for t in tokens]


def _import(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserInputError(
            f"search_qa.retriever 'dense' needs the '{package}' package, which is not installed: "
            f"pip install 'treegrpo-ray[dense]' (or pip install {package}), or use "
            "search_qa.retriever: bm25"
        ) from err


class DenseIndex:
    """A sentence-transformers encoder and a faiss inner-product index over the passages."""

    def __init__(self, texts: Sequence[str], model_path: str, index_path: str | None = None):
        st = _import("sentence_transformers", "sentence-transformers")
        self._faiss = _import("faiss", "faiss-cpu")
        self.encoder = st.SentenceTransformer(model_path)
        if index_path is not None:
            self.index = self._faiss.read_index(index_path)
            if self.index.ntotal != len(texts):
                raise UserInputError(
                    f"the faiss index {index_path} holds {self.index.ntotal} vectors but the "
                    f"corpus has {len(texts)} passages; use the index built for this corpus"
                )
            return
        vectors = self._encode([PASSAGE_PREFIX + t for t in texts])
        self.index = self._faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def _encode(self, texts: list[str]) -> np.ndarray:
        vectors = self.encoder.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def top_k(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        scores, ids = self.index.search(self._encode([QUERY_PREFIX + q for q in queries]), k)
        return [
            [(int(i), float(s)) for i, s in zip(row_ids, row_scores, strict=True) if i >= 0]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


class Retriever:
    """Top-k passages for many queries at once, over an in-memory corpus.

    ``corpus``: the passages, or the path of a corpus jsonl (``treegrpo_ray.envs.qa_data.load_corpus``),
    read here so that a Ray actor loads a large corpus itself. ``method``: ``bm25`` or ``dense``
    (needs ``dense_model``). ``index_path``: bm25, a directory caching the index; dense, a prebuilt
    faiss index whose row i is passage i.
    """

    def __init__(
        self,
        corpus: Sequence[Passage] | str,
        method: Literal["bm25", "dense"] = "bm25",
        dense_model: str | None = None,
        index_path: str | None = None,
    ):
        self.passages = load_corpus(corpus) if isinstance(corpus, str) else list(corpus)
        texts = [f"{p.title} {p.text}" for p in self.passages]
        self.index: BM25Index | DenseIndex
        if method == "bm25":
            self.index = BM25Index(texts, index_path)
        elif method == "dense":
            if dense_model is None:
                raise UserInputError("the dense retriever needs search_qa.dense_model (a path)")
            self.index = DenseIndex(texts, dense_model, index_path)
        else:
            raise UserInputError(f"unknown retriever method {method!r}; use 'bm25' or 'dense'")

    @classmethod
    def from_corpus(
        cls, passages: Sequence[Passage], method: Literal["bm25", "dense"] = "bm25", **options: Any
    ) -> Retriever:
        """A retriever over ``passages`` (``options``: ``dense_model``, ``index_path``)."""
        return cls(passages, method, **options)

    @classmethod
    def from_config(cls, cfg: SearchQAConfig) -> Retriever:
        """The retriever the ``search_qa`` config section describes."""
        return cls(**retriever_kwargs(cfg))

    def num_passages(self) -> int:
        """Passages in the corpus (also a cheap readiness probe for the actor)."""
        return len(self.passages)

    def search_batch(self, queries: list[str], k: int) -> list[list[Passage]]:
        """For each query, its top ``k`` passages (``score`` set), best first."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not queries:
            return []
        hits = self.index.top_k(list(queries), k)
        return [[dataclasses.replace(self.passages[i], score=s) for i, s in row] for row in hits]


def retriever_kwargs(cfg: SearchQAConfig) -> dict[str, Any]:
    """``Retriever(**kwargs)`` for the config: the fixture's passages, or the corpus path (so the
    process that builds the retriever reads the corpus, not the one that starts it)."""
    corpus: Sequence[Passage] | str
    if cfg.fixture:
        corpus = build_fixture(cfg.fixture_seed).passages
    elif cfg.corpus_path is not None:
        corpus = str(Path(cfg.corpus_path).expanduser())
    else:
        raise UserInputError("search_qa.corpus_path is not set; set it or search_qa.fixture: true")
    return {
        "corpus": corpus,
        "method": cfg.retriever,
        "dense_model": cfg.dense_model,
        "index_path": cfg.index_path,
    }
