"""The retriever of a search_qa job as one named Ray actor, and the client rollout workers call.

One actor holds the corpus and the index (a Wikipedia dump is too big to copy into every rollout
worker); each rollout worker gets a ``RetrieverClient`` and passes it to its environment as the
batched ``search`` callable, so one wave of tree expansions is one call to the actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from treegrpo_ray.actors.retriever import Retriever, retriever_kwargs
from treegrpo_ray.envs.qa_data import Passage
from treegrpo_ray.envs.search_qa import SearchQAConfig


def retriever_actor_name(job_name: str) -> str:
    """The actor name of a job's retriever (one per job, so jobs never share or clash)."""
    return f"treegrpo-retriever-{job_name}"


@dataclass(frozen=True)
class RetrieverClient:
    """A picklable handle on the retriever actor with the environment's ``search`` signature."""

    handle: Any

    def __call__(self, queries: list[str], k: int) -> list[list[Passage]]:
        """``Retriever.search_batch`` on the actor: one round trip for all ``queries``."""
        if not queries:
            return []
        return ray.get(self.handle.search_batch.remote(list(queries), k))

    def ready(self) -> int:
        """Block until the actor has built its index; returns the number of passages."""
        return ray.get(self.handle.num_passages.remote())


def start_retriever(
    cfg: SearchQAConfig,
    name: str,
    num_cpus: float = 1,
    resources: dict[str, float] | None = None,
    detached: bool = False,
) -> RetrieverClient:
    """Start (or join, when ``name`` already runs) the retriever actor; returns its client.

    The actor loads the corpus and builds the index itself (``retriever_kwargs`` passes the corpus
    path, not the passages). Searches are read-only, so a restarted actor may retry them
    transparently. ``detached`` keeps it alive after the starting process exits (until
    ``ray.kill``); by default it lives as long as the process that started it (the job's driver or
    controller).
    """
    options: dict[str, Any] = {
        "name": name,
        "get_if_exists": True,
        "num_cpus": num_cpus,
        "resources": dict(resources or {}),
        "max_restarts": -1,
        "max_task_retries": -1,
    }
    if detached:
        options["lifetime"] = "detached"
    handle = ray.remote(Retriever).options(**options).remote(**retriever_kwargs(cfg))
    return RetrieverClient(handle)
