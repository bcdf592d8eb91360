"""Faults and scaling in a running job on a real local Ray: a killed rollout worker, a killed
learner worker, the rollout pool scaled 1 -> 2 -> 1. Every prompt group must reach the learner
exactly once. The test drives the job through the controller's handle (``train(on_start=...)``)
and synchronises on its futures, never on sleeps."""

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from treegrpo_ray.cluster.train import train

pytestmark = pytest.mark.ray
FINISH_WAIT_S = 420  # from the job's start; within pytest's 600 s per test, with room to stop


class RunningJob:
    """``train`` in a thread; ``controller`` is set (an event) as soon as the job has one.

    The test's own Ray calls (``call``, ``kill_actor``) run on a thread of their own, new to Ray.
    Ray derives task ids from a per-thread context that outlives ``ray.shutdown``: the pytest
    main thread keeps the driver task id of the last session it started, which is the id the
    job's thread gets in this one (job 01000000 again), so both threads would number tasks to
    the controller from the same parent id, and a repeated id aborts the process ("Tried to
    create an owned object that already exists")."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.deadline = time.monotonic() + FINISH_WAIT_S
        self.caller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-calls")
        self.started = threading.Event()
        self.outcome = {}
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()
        assert self.started.wait(timeout=600), "the job did not start in 600 s"
        if "error" in self.outcome:
            raise self.outcome["error"]
        self.controller = self.outcome["controller"]

    def _train(self):
        try:
            self.outcome["summary"] = train(self.cfg, progress=False, on_start=self._started)
        except Exception as err:  # surfaced by finish()
            self.outcome["error"] = err
            self.started.set()

    def _started(self, controller):
        self.outcome["controller"] = controller
        self.started.set()

    def call(self, method, *args, **kwargs):
        remote = getattr(self.controller, method).remote
        return self.caller.submit(lambda: ray.get(remote(*args, **kwargs))).result()

    def kill_actor(self, actor):
        """Kill ``actor`` (Ray restarts it: ``no_restart=False``)."""
        self.caller.submit(ray.kill, actor, no_restart=False).result()

    def finish(self):
        """The job's summary once it ends. A job still running ``FINISH_WAIT_S`` after it
        started is stopped (so that its Ray session ends with this test, not in the next ones)
        and the test fails with what it had done."""
        self.thread.join(timeout=max(0.0, self.deadline - time.monotonic()))
        if self.thread.is_alive():
            # the records only: a summary would also ask the workers, which may be what hangs
            done = self.call("progress", after_step=0, timeout=0.0)
            self.call("abort", "the test stopped a job that did not finish")
            self.thread.join()
            steps = [record["step"] for record in done.records]
            pytest.fail(f"the job did not finish in {FINISH_WAIT_S} s; steps recorded: {steps}")
        self.caller.shutdown()
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["summary"]


@pytest.fixture
def job_cfg(make_cfg, tiny_policy):
    def make(name, *overrides):
        return make_cfg(
            f"name={name}",
            "train.steps=3",
            "train.prompts_per_step=4",
            "cluster.groups_per_lease=2",
            "train.eval_every=0",
            "train.final_eval_questions=8",
            "cluster.torch_threads=1",
            *overrides,
        )

    return make


def _assert_each_group_once(cfg, summary):
    expected = cfg.train.steps * cfg.train.prompts_per_step
    assert summary["groups/consumed"] == expected
    assert summary["groups/duplicates"] == 0
    assert summary["steps"] == cfg.train.steps
    # batches reach the queue in step order, so none is too old for the update that takes it
    records = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert {json.loads(line)["tree/dropped_stale_groups"] for line in records} == {0.0}


def test_a_rollout_worker_killed_mid_step_is_restarted_and_its_lease_reissued(job_cfg):
    cfg = job_cfg("fault-rollout", "train.checkpoint_every=0")
    job = RunningJob(cfg)

    busy = job.call("workers_with_lease", timeout=300)
    assert busy, "no lease was issued"
    job.kill_actor(next(iter(busy.values())))  # dies mid-lease; Ray restarts it

    summary = job.finish()
    _assert_each_group_once(cfg, summary)
    records = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["rollout/worker_failures"] >= 1
    assert summary["rollout/worker_versions"] == [cfg.train.steps]


def test_scaling_the_rollout_pool_loses_and_duplicates_no_group(job_cfg):
    # Room for a second worker: Ray is started with CPUs for 1 x 0.5 (rollout) + 1 (learner).
    cfg = job_cfg("scale", "train.steps=4", "train.max_policy_lag=1", "cluster.rollout_cpus=0.5")
    job = RunningJob(cfg)

    grown = job.call("scale", 2)
    assert grown.rollout_workers == 2
    # the new worker loads the newest policy when it is added; the job, already training, may
    # publish another version while the worker is placed, before the reply (as in test_jobs)
    assert grown.added_versions and max(grown.added_versions) <= grown.policy_version
    job.call("wait_records", after_step=1, timeout=600)
    shrunk = job.call("scale", 1)
    assert shrunk.rollout_workers == 1

    summary = job.finish()
    _assert_each_group_once(cfg, summary)
    assert len(summary["rollout/worker_versions"]) == 1


@pytest.mark.parametrize(
    "pipeline",
    [
        pytest.param(("fault-learner",), id="in-step"),
        # workers two versions ahead and room for one batch: the queue is mostly full and a put
        # waits, so the rewind's drain must come after it and drop what it put
        pytest.param(
            ("fault-learner-full", "cluster.queue_size=1", "train.max_policy_lag=2"),
            id="full-queue",
        ),
    ],
)
def test_a_killed_learner_is_restarted_from_its_checkpoint(job_cfg, pipeline):
    name, *settings = pipeline
    cfg = job_cfg(name, "train.steps=4", "train.checkpoint_every=1", *settings)
    job = RunningJob(cfg)

    job.call("wait_records", after_step=1, timeout=600)  # step 2 is published
    learner = job.call("learner_processes")[0]
    os.kill(learner.pid, signal.SIGKILL)

    summary = job.finish()
    _assert_each_group_once(cfg, summary)
    records = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # continuous: no gap, no repeat
    assert summary["learner/restarts"] == 1
