"""The held-out evaluator's shards and retries, run on asyncio with in-process stand-ins for the
rollout workers' actor handles (test doubles: they play a worker that dies mid-call, which the
Ray tier cannot time reliably)."""

import asyncio
import contextlib

import pytest
from ray.exceptions import RayActorError

from treegrpo_ray.cluster.evaluation import SHARD_ATTEMPTS, Evaluator, Measurement, Snapshot
from treegrpo_ray.envs.base import Sample

SAMPLES = [Sample(f"q{i}", f"question {i}", (str(i),)) for i in range(6)]
SOLVED = {"q0", "q1", "q4"}  # half of them
GREEDY = Measurement("eval/greedy_em", questions=6, temperature=0.0)


class StandInWorker:
    """Test double of a rollout worker's handle: ``evaluate.remote(samples, temperature, seed,
    version)`` scores a sample 1.0 when it is in ``SOLVED``; its first ``dies`` calls fail as a
    dead worker's calls do (``RayActorError``)."""

    def __init__(self, dies: int = 0):
        self.evaluate = self
        self.dies = dies
        self.shards: list[list[str]] = []

    def remote(
        self, samples: list[Sample], temperature: float, seed: int, version: int
    ) -> asyncio.Future:
        self.shards.append([s.uid for s in samples])
        died, self.dies = self.dies > 0, max(self.dies - 1, 0)

        async def answer() -> list[float]:
            if died:
                raise RayActorError()
            return [float(s.uid in SOLVED) for s in samples]

        return asyncio.ensure_future(answer())


def measure(workers: list[StandInWorker]) -> tuple[dict[str, float], int]:
    """The evaluator's result on ``workers``, and how often it asked which workers to use."""
    asked = []

    def workers_on(snapshot: Snapshot) -> list[StandInWorker]:
        asked.append(snapshot.version)
        return workers

    async def changed(timeout: float) -> None:
        raise AssertionError("no wait: the workers are there")

    evaluator = Evaluator(SAMPLES, 7, workers_on, contextlib.nullcontext, changed)
    result = asyncio.run(evaluator.measure(Snapshot(3, None), [GREEDY]))
    return result, len(asked)


def test_a_shard_whose_worker_died_is_sent_again_and_counted_once():
    first, second = StandInWorker(dies=1), StandInWorker()
    result, asked = measure([first, second])
    assert result == {"eval/greedy_em": 0.5, "eval/policy_version": 3.0}
    assert first.shards == [["q0", "q2", "q4"], ["q0", "q2", "q4"]]  # sent again to it
    assert second.shards == [["q1", "q3", "q5"]]
    assert asked == 2  # once for the shards, once again for the retry


def test_workers_that_keep_dying_fail_the_evaluation_after_the_last_attempt():
    worker = StandInWorker(dies=SHARD_ATTEMPTS)
    with pytest.raises(RuntimeError, match=f"its workers died {SHARD_ATTEMPTS} times"):
        measure([worker])
    assert len(worker.shards) == SHARD_ATTEMPTS
