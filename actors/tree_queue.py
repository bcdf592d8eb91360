"""Bounded object-store queue of tree batches (DESIGN §4, Queue).

Only ObjectRefs pass through the queue actor, wrapped in a ``QueueItem`` so Ray does not resolve
them on the way: the Arrow payload stays in the object store until the learner reads it.
The producer (the job's controller, an asyncio actor) puts without blocking its event loop and
waits while the queue is full (backpressure); the learners' ``get`` blocks.
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

    async def put(self, ref: ray.ObjectRef, timeout: float) -> None:
        """Enqueue one tree batch by reference, waiting up to ``timeout`` s for room (``Full``)."""
        await self._queue.put_async(QueueItem(refs=[ref]), timeout=timeout)

    async def put_error(self, message: str, timeout: float) -> None:
        """Tell the consumer that production failed (it raises instead of waiting forever).

        In a full queue the oldest batch makes room: production failed, so the run stops, and
        the error must get through. Gives up after ``timeout`` s (``Full``)."""
        item = QueueItem(error=message)
        try:
            await self._queue.put_async(item, block=False)
        except Full:
            with contextlib.suppress(Empty):
                await self._queue.get_async(block=False)
            await self._queue.put_async(item, timeout=timeout)

    def get(self, timeout: float | None = None) -> pa.Table:
        """Dequeue the next tree batch and fetch its table from the object store."""
        item = self._queue.get(timeout=timeout)
        if item.error is not None:
            raise RuntimeError(f"rollout failed: {item.error}")
        return ray.get(item.refs[0])

    async def drain(self) -> int:
        """Drop every queued batch (a rewind); returns how many were dropped."""
        dropped = 0
        while True:
            try:
                await self._queue.get_async(block=False)
            except Empty:
                return dropped
            dropped += 1

    async def size(self) -> int:
        # ray.util.queue types its actor handle as the actor's class
        return await self._queue.actor.qsize.remote()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        self._queue.shutdown()
