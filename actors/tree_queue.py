"""Bounded object-store queue of tree batches (DESIGN §4, Queue).

Only ObjectRefs pass through the queue actor, wrapped in a ``QueueItem`` so Ray does not resolve
them on the way: the Arrow payload stays in the object store until the learner reads it.
Producers block while the queue is full (backpressure).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pyarrow as pa
import ray
from ray.util.queue import Empty, Full, Queue


@dataclass
class QueueItem:
    """refs: the tree batch (one Arrow table); error: set when the producer failed."""

    refs: list[ray.ObjectRef] = field(default_factory=list)
    error: str | None = None


class TreeQueue:
    """A bounded queue of tree-batch references; picklable, so actors can share it."""

    def __init__(self, maxsize: int):
        self._queue = Queue(maxsize=maxsize, actor_options={"num_cpus": 0})

    def put(self, ref: ray.ObjectRef, timeout: float | None = None) -> None:
        """Enqueue one tree batch by reference; blocks while the queue is full."""
        self._queue.put(QueueItem(refs=[ref]), timeout=timeout)

    def put_error(self, message: str, timeout: float) -> None:
        """Tell the consumer that production failed (it raises instead of waiting forever).

        In a full queue the oldest batch makes room: production failed, so the run stops, and
        the error must get through. Gives up after ``timeout`` s (``Full``)."""
        item = QueueItem(error=message)
        try:
            self._queue.put_nowait(item)
        except Full:
            with contextlib.suppress(Empty):
                self._queue.get_nowait()
            self._queue.put(item, timeout=timeout)

    def get(self, timeout: float | None = None) -> pa.Table:
        """Dequeue the next tree batch and fetch its table from the object store."""
        item = self._queue.get(timeout=timeout)
        if item.error is not None:
            raise RuntimeError(f"rollout failed: {item.error}")
        return ray.get(item.refs[0])

    def drain(self) -> int:
        """Drop every queued batch (a rewind); returns how many were dropped."""
        dropped = 0
        while not self._queue.empty():
            try:
                self._queue.get_nowait()
            except Empty:
                break
            dropped += 1
        return dropped

    def size(self) -> int:
        return self._queue.size()

    def shutdown(self) -> None:
        self._queue.shutdown()
