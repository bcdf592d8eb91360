"""The job state replayed event by event: leases, deaths, scaling, evaluations and rewinds,
without Ray or threads (the controller executes the same commands on a real cluster)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from treegrpo_ray.actors.schedule import Lease, LeaseReceipt, step_leases, training_order
from treegrpo_ray.cluster.job_state import (
    DrainQueue,
    Enqueue,
    JobState,
    Probe,
    ScaleResult,
    SendPolicy,
    StartLease,
    StartWorker,
    StopWorker,
    WorkerDeath,
)
from treegrpo_ray.engine import EngineCounters
from treegrpo_ray.envs.base import Sample
from treegrpo_ray.tree import BatchInfo

PROMPTS_PER_STEP, LEASE_SIZE = 4, 2  # two leases a step
SAMPLES = [Sample(f"q{i}", f"question {i}", (str(i),)) for i in range(16)]


def leases_of_step(step: int) -> list[Lease]:
    order = training_order(len(SAMPLES), seed=3)
    return step_leases(SAMPLES, order, step, PROMPTS_PER_STEP, LEASE_SIZE, seed=3)


def job(workers: int, steps: int = 3, lag: int = 0, resume_from: int | None = None) -> JobState:
    state = JobState(leases_of_step, steps, lag, max_restarts=2, resume_from=resume_from)
    assert state.add_workers(workers) == [StartWorker(w) for w in range(workers)]
    return state


def receipt(lease: Lease, seconds: float = 1.0) -> LeaseReceipt:
    info = BatchInfo(lease.lease_id, 0, {}, rollout_seconds=seconds)
    return LeaseReceipt(info, EngineCounters(), peak_rss_bytes=7)


def started(commands: list) -> dict[int, StartLease]:
    """The leases the commands start, by ticket."""
    return {c.ticket: c for c in commands if isinstance(c, StartLease)}


def finish(state: JobState, leases: dict[int, StartLease]) -> list[int]:
    """Every lease done; the prompt groups of the batches enqueued."""
    groups = []
    for ticket, start in leases.items():
        assert Enqueue(ticket) in state.lease_done(ticket, receipt(start.lease))
        groups += [g for g, _ in start.lease.groups]
    return groups


def test_each_idle_worker_gets_the_next_lease_and_a_step_waits_for_its_policy():
    state = job(workers=2)
    first = state.next_leases()
    assert [(c.worker_id, c.lease) for c in first] == list(
        zip([0, 1], leases_of_step(0), strict=True)
    )
    assert state.next_leases() == []  # both busy, and step 1 waits for policy 1 (lag 0)
    assert finish(state, started(first)) == [0, 1, 2, 3]
    assert state.next_leases() == []
    state.published(1, [0, 1, 2, 3])
    second = state.next_leases()
    assert second[0] == SendPolicy(0, 1)  # the newest policy before the next lease
    assert [c.lease for c in second if isinstance(c, StartLease)] == leases_of_step(1)
    assert state.counters.busy_s == 2.0 and state.counters.peak_rss_bytes == 7


def test_a_lag_of_one_plans_the_next_step_before_the_policy_arrives():
    state = job(workers=4, lag=1)
    leases = [c.lease for c in state.next_leases() if isinstance(c, StartLease)]
    assert leases == leases_of_step(0) + leases_of_step(1)


def test_a_worker_killed_mid_lease_loses_no_group_and_takes_no_lease_until_it_answers():
    state = job(workers=2)
    leases = started(state.next_leases())
    lost_ticket, kept_ticket = sorted(leases)
    commands = state.lease_lost(lost_ticket, WorkerDeath(True, "killed", memory_kill=True))
    assert commands == [Probe(0)]
    assert state.counters.failures == 1 and state.counters.memory_kills == 1
    assert state.next_leases() == []  # worker 1 busy, worker 0 restarting
    # the second lease's batch waits for the first's: the learner takes them in step order
    assert state.lease_done(kept_ticket, receipt(leases[kept_ticket].lease)) == []
    reissued = started(state.next_leases())
    assert [(c.worker_id, c.lease) for c in reissued.values()] == [(1, leases[lost_ticket].lease)]
    (again,) = reissued
    assert state.lease_done(again, receipt(reissued[again].lease)) == [
        Enqueue(again),
        Enqueue(kept_ticket),
    ]
    groups = [g for start in (reissued[again], leases[kept_ticket]) for g, _ in start.lease.groups]
    assert groups == [0, 1, 2, 3]  # each group once
    state.probe_answered(0)
    state.published(1, groups)
    commands = state.next_leases()
    assert commands[0] == SendPolicy(0, 1)
    assert sorted(c.worker_id for c in started(commands).values()) == [0, 1]


def test_a_restarted_worker_is_brought_to_the_newest_policy_before_its_lease():
    state = job(workers=1)
    state.published(1, [])
    state.next_step = 1
    leases = started(state.next_leases())
    (ticket,) = leases
    assert state.lease_lost(ticket, WorkerDeath(True, "killed")) == [Probe(0)]
    state.probe_answered(0)
    commands = state.next_leases()
    assert commands[0] == SendPolicy(0, 1)  # the fresh instance was on the initial policy
    assert started(commands)[1].lease == leases[ticket].lease


def test_a_worker_gone_for_good_leaves_and_the_last_one_stops_the_job():
    state = job(workers=2)
    leases = sorted(started(state.next_leases()))
    assert state.lease_lost(leases[0], WorkerDeath(False, "died")) == [StopWorker(0)]
    assert state.active() == [1]
    with pytest.raises(RuntimeError, match=r"rollout_max_restarts = 2\); the last: died again"):
        state.lease_lost(leases[1], WorkerDeath(False, "died again"))


def test_scaling_1_to_2_to_1_during_an_evaluation_stops_the_worker_only_when_it_ends():
    state = job(workers=1)
    state.published(1, [])
    state.evaluation_started()
    commands = state.add_workers(1, probe=True)
    assert commands == [StartWorker(1), SendPolicy(1, 1), Probe(1)]
    assert state.usable() == [0]
    state.probe_answered(1)
    workers, sends = state.evaluation_workers(1, can_send=True)
    assert workers == [0, 1] and sends == [SendPolicy(0, 1)]  # worker 1 is on it already
    assert state.shrink_to(1) == []  # worker 1 holds a shard of the evaluation
    assert state.active() == [0] and 1 in state.workers
    state.next_step = 1
    assert {c.worker_id for c in started(state.next_leases()).values()} == {0}
    assert state.evaluation_finished() == [StopWorker(1)]
    assert list(state.workers) == [0]


def test_a_retiring_worker_finishes_its_lease_first():
    state = job(workers=2)
    leases = started(state.next_leases())
    assert state.shrink_to(1) == []  # worker 1 holds a lease
    first, second = sorted(leases)  # worker 0's and worker 1's
    # stopped once its lease is done; the batch waits in the object store for the first lease's
    assert state.lease_done(second, receipt(leases[second].lease)) == [StopWorker(1)]
    assert state.lease_done(first, receipt(leases[first].lease)) == [
        Enqueue(first),
        Enqueue(second),
    ]
    assert state.add_workers(1) == [StartWorker(2)]  # ids are never reused


def test_batches_are_enqueued_in_lease_order_whichever_worker_finishes_first():
    # Two workers, a lag of 1: worker 0 finishes step 0's first lease and runs step 1's first
    # lease while worker 1 still runs step 0's second. Enqueued as they finish, step 1's batch
    # would complete update 1 and leave step 0's second batch (policy 0) to update 2, which
    # drops it as older than 2 - 1: its groups would never reach the learner.
    state = job(workers=2, lag=1)
    step0 = started(state.next_leases())
    a, b = sorted(step0)
    assert state.lease_done(a, receipt(step0[a].lease)) == [Enqueue(a)]
    (c,) = started(state.next_leases()).values()
    assert c.worker_id == 0 and c.lease == leases_of_step(1)[0]
    assert state.lease_done(c.ticket, receipt(c.lease)) == []  # waits for step 0's second
    assert state.lease_done(b, receipt(step0[b].lease)) == [Enqueue(b), Enqueue(c.ticket)]


def test_a_restore_with_a_full_queue_drops_the_batches_and_redoes_the_same_groups():
    state = job(workers=2, lag=1)
    step0 = started(state.next_leases())
    finish(state, step0)  # step 0's batches wait in the queue
    state.published(1, [0, 1, 2, 3])
    in_flight = started(state.next_leases())  # step 1, and step 2 is due
    assert [c.lease for c in in_flight.values()] == leases_of_step(1)
    state.published(2, [4, 5, 6, 7])
    commands = state.restored(1)
    assert commands == [DrainQueue(), SendPolicy(0, 1), SendPolicy(1, 1)]
    for ticket, start in in_flight.items():  # their receipts arrive after the rewind
        assert state.lease_done(ticket, receipt(start.lease)) == []
    assert dict(state.consumed_counts()) == {0: 1, 1: 1, 2: 1, 3: 1}
    redone = started(state.next_leases())
    assert not set(redone) & set(in_flight)  # new tickets
    assert [c.lease for c in redone.values()] == leases_of_step(1)  # the same groups and seeds


def test_a_resumed_job_issues_nothing_before_the_learner_restores_its_version():
    state = job(workers=1, resume_from=2)
    assert state.next_leases() == []
    assert state.restored(2) == [DrainQueue(), SendPolicy(0, 2)]
    assert started(state.next_leases())[0].lease == leases_of_step(2)[0]


def test_an_evaluation_without_weights_uses_only_the_workers_on_its_version():
    state = job(workers=2)
    state.published(1, [])
    state.evaluation_started()
    assert state.evaluation_workers(0, can_send=False) == ([0, 1], [])  # still on the initial
    workers, sends = state.evaluation_workers(1, can_send=True)
    assert workers == [0, 1] and sends == [SendPolicy(0, 1), SendPolicy(1, 1)]
    assert state.evaluation_workers(0, can_send=False) == ([], [])


def test_the_latest_failure_is_the_one_reported():
    state = job(workers=1)
    state.fail("rollout", "rollout failed: boom")
    state.fail("learner", "learner failed; saved step 3")
    assert (state.failure.source, str(state.failure)) == ("learner", "learner failed; saved step 3")


def test_the_job_state_imports_no_ray():
    code = (
        "import sys; import treegrpo_ray.cluster.job_state; "
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_scale_answer_travels_as_one_json_line():
    answer = ScaleResult(rollout_workers=2, policy_version=5, added_versions=[4])
    assert ScaleResult.from_json(answer.to_json()) == answer
    with pytest.raises(ValueError, match="not a scale answer: 'Traceback"):
        ScaleResult.from_json("Traceback (most recent call last):")
    with pytest.raises(ValueError, match="not a scale answer"):
        ScaleResult.from_json('{"rollout_workers": 2}')


def test_a_restarting_worker_whose_probe_finds_it_dead_leaves_the_pool():
    state = job(workers=2)
    (ticket, _), *_ = started(state.next_leases()).items()
    assert state.lease_lost(ticket, WorkerDeath(True, "killed")) == [Probe(0)]
    assert state.worker_lost(0, WorkerDeath(False, "restarts used up")) == [StopWorker(0)]
    assert state.counters.failures == 2 and state.counters.last_failure == "restarts used up"
    assert state.active() == [1]


def test_a_retiring_worker_that_dies_mid_lease_is_stopped_and_its_lease_reissued():
    state = job(workers=2)
    leases = started(state.next_leases())
    state.shrink_to(1)
    ticket = next(t for t, c in leases.items() if c.worker_id == 1)
    assert state.lease_lost(ticket, WorkerDeath(True, "killed")) == [Probe(1), StopWorker(1)]
    assert list(state.workers) == [0]
    assert state.backlog[0] == leases[ticket].lease
