"""End to end through the real Ray pipeline: local Ray, rollout actor, queue, Ray Train learner."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from treegrpo_ray.cluster.local_run import LocalRun
from treegrpo_ray.cluster.train import FIT_THREAD, resume_step, train
from treegrpo_ray.commands.cli import main
from treegrpo_ray.config import resume_config
from treegrpo_ray.learners.policies import resolve_model_path
from treegrpo_ray.modeling import load_policy
from treegrpo_ray.saved_trees import read_saved_trees
from treegrpo_ray.tooling.inspector import load_steps

pytestmark = pytest.mark.ray

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
# A stopped run's Ray processes exit while it shuts Ray down; this bounds a wait for stragglers.
STOPPED_PROCESS_WAIT_S = 120


@pytest.fixture(scope="module")
def two_step_run(make_cfg, tiny_policy, two_step_overrides):
    """``two_step_run(learners)``: (config, summary) of a 2-update run, trained once per module."""
    runs = {}

    def run(learners: int):
        if learners not in runs:
            cfg = make_cfg(f"name=e2e-{learners}", *two_step_overrides(learners))
            runs[learners] = cfg, train(cfg, progress=False)
        return runs[learners]

    return run


@pytest.mark.parametrize("learners", [1, 2], ids=["1-learner", "2-learners"])
def test_two_updates_change_every_parameter_and_reach_the_workers(
    two_step_run, tiny_policy, learners
):
    cfg, summary = two_step_run(learners)

    assert summary["rollout/worker_versions"] == [2]
    assert summary["steps"] == 2
    before = load_file(f"{tiny_policy}/model.safetensors")
    after = load_file(str(cfg.run_dir / "checkpoint-final" / "model.safetensors"))
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == []

    records = [
        json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2]
    # a process holding the policy holds at least its weights (the kernel's VmHWM)
    weights = 4 * sum(p.numel() for p in load_policy(resolve_model_path(cfg))[0].parameters())
    for record in records:
        assert record["learner/policy_version"] == record["step"]
        assert record["tree/groups"] == 4
        assert record["tree/leaves"] == 4 * cfg.tree.shape().leaves_per_prompt
        assert "eval/greedy_em" in record and "budget/generated_tokens" in record
        assert 0.0 <= record["rollout/cache_hit_rate"] < 1.0
        assert record["rollout/peak_rss_bytes"] > weights
        assert record["learner/peak_rss_bytes"] > weights
        assert record["rollout/memory_kills"] == 0
    for key in ("before/eval/sampled_em", "after/eval/sampled_em", "after/eval/greedy_em"):
        assert 0.0 <= summary[key] <= 1.0
    assert "held-out EM" in summary["line"]
    assert any((cfg.run_dir / "tensorboard").iterdir())
    checkpoints = cfg.run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000001", "step-000002"]
    # the trees of the first and the last update (train.save_trees_every 10), nothing else
    saved = sorted(p.name for p in (cfg.run_dir / "trees").iterdir())
    assert saved == ["step-000001.parquet", "step-000002.parquet"]
    for record in records:
        table, meta = read_saved_trees(cfg.run_dir, record["step"])
        assert table.num_rows == record["tree/nodes"]
        assert sum(table.column("finished").to_pylist()) == record["tree/leaves"]
        assert meta["metrics"]["budget/tool_calls"] == record["budget/tool_calls"]


def test_profile_reads_the_runs_saved_trees(two_step_run, tmp_path):
    cfg, _ = two_step_run(1)
    assert main(["bench", "profile", "--run", str(cfg.run_dir), "--out", str(tmp_path)]) == 0
    profile = json.loads((tmp_path / "profile.json").read_text())
    records = [
        json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert profile["prompts"] == sum(r["tree/groups"] for r in records)
    assert profile["leaves"] == sum(r["tree/leaves"] for r in records)
    # the profile's own count of prompts whose leaves differ is the run's metric
    shares = [r["tree/groups_with_variance"] * r["tree/groups"] for r in records]
    assert profile["share_in_data"] == pytest.approx(sum(shares) / profile["prompts"])


def test_the_last_evaluation_measures_the_last_policy_after_the_learner_finished(
    make_cfg, tiny_policy, two_step_overrides
):
    """The worker evaluates version 1 on the whole held-out set while the learner publishes
    version 2 and finishes; the final evaluation's load of version 2 (an object of the learner's
    process) comes after that. The learner waits for the evaluations before it exits, so the
    load succeeds and step 2's record measures version 2 (without the wait the load failed in
    most runs here, and the worker refused to measure the version it still held)."""
    cfg = make_cfg("name=eval-outlasts-learner", *two_step_overrides(), "train.eval_questions=1024")
    summary = train(cfg, progress=False)
    assert summary["rollout/worker_versions"] == [2]
    assert [r["eval/policy_version"] for r in _read_records(cfg.run_dir)] == [1.0, 2.0]


# Not a function of the seed: wall-clock times, the prefix-cache counters (the cache is not
# checkpointed: the uninterrupted run's cache still held the step-1 evaluation's prefixes), and the
# engine's float figures over prefixes served from that cache (its sampling entropies, which agree
# to ~1e-6, not bit for bit).
UNREPEATABLE = (
    "timing/",
    "queue/",
    "learner/idle_frac",
    "rollout/idle_frac",
    "rollout/peak_rss_bytes",
    "learner/peak_rss_bytes",
    "rollout/seconds",
    "rollout/planner_seconds",
    "rollout/entropy_mean",
    "rollout/tokens_per_s",
    "rollout/cache",
    "rollout/prefill_tokens",
    "rollout/cached_tokens",
    "budget/prefill_tokens",
    "budget/cached_tokens",
)


@pytest.mark.parametrize("loss", ["unwritten", "damaged"])
def test_resume_continues_as_the_uninterrupted_run(two_step_run, tmp_path, loss, capsys):
    """The job dies after publishing step 2 but before its checkpoint was complete (unwritten:
    the newest complete checkpoint is step 1), or step 2's checkpoint was damaged afterwards (its
    weights cut to half, as a full disk leaves them): either way the resume continues from step
    1, and metrics.jsonl already has step 2."""
    cfg, full = two_step_run(learners=1)
    died = tmp_path / "died"
    # the resumed run writes step 2's trees anew: they are compared below
    unsaved = shutil.ignore_patterns("ray_train", "checkpoint-*", "step-000002.parquet")
    shutil.copytree(cfg.run_dir, died, ignore=unsaved)
    if loss == "unwritten":
        shutil.rmtree(died / "checkpoints" / "step-000002")
        (died / "checkpoints" / "latest").write_text("step-000001\n")
    else:
        weights = died / "checkpoints" / "step-000002" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (died / "summary.json").unlink()

    assert main(["train", "--resume", str(died), "--quiet"]) == 0
    if loss == "damaged":
        err = capsys.readouterr().err
        assert "checkpoint step-000002 is damaged (model.safetensors has" in err
        assert "resuming from step-000001" in err

    resumed = json.loads((died / "summary.json").read_text())
    assert resumed["steps"] == 2 and resumed["rollout/worker_versions"] == [2]
    records = [_read_records(cfg.run_dir), _read_records(died)]
    assert [[r["step"] for r in run] for run in records] == [[1, 2], [1, 2]]
    expected_trees, got_trees = (_tree_rows(d, step=2) for d in (cfg.run_dir, died))
    assert got_trees == expected_trees
    expected, got = (_repeatable(run[1]) for run in records)
    # rewards, tokens, tool calls, evaluations exactly; the learner's float figures and the
    # weights after step 2 to 1e-6: in two full suites (both cores busy) the resumed update 2,
    # on equal trees from the same checkpoint, came out with the same gradient norm 8e-8
    # (relative) apart both times and its KL 4e-8 apart: another kernel path taken now and then,
    # cause not found (issue 27); a state the resume lost would show every time, far above 1e-6
    learner = [k for k in expected if k.startswith("learner/")]
    assert {k: got.pop(k) for k in learner} == pytest.approx(
        {k: expected.pop(k) for k in learner}, rel=1e-6, abs=1e-6
    )
    assert got == expected
    for key in ("before/eval/sampled_em", "after/eval/sampled_em", "budget/generated_tokens"):
        assert resumed[key] == full[key]
    assert _close_tensors(cfg.run_dir / "checkpoint-final", died / "checkpoint-final", atol=1e-6)


def test_the_in_process_loop_reproduces_the_ray_job(two_step_run, tmp_path):
    """``treegrpo_ray.cluster.local_run`` (what the budget suite trains with) takes the job's
    steps exactly, and keeps the same trees as the job (the inspector opens them)."""
    cfg, summary = two_step_run(learners=1)
    run = LocalRun(cfg, resolve_model_path(cfg, progress=False), save_trees_to=tmp_path)
    assert run.evaluate(cfg.train.final_eval_questions, 1.0) == summary["before/eval/sampled_em"]
    for expected in _read_records(cfg.run_dir):
        got = run.step()
        got["eval/greedy_em"] = run.evaluate(cfg.train.eval_questions, temperature=0.0)
        same = {k: v for k, v in _repeatable(expected).items() if k in got}
        assert len(same) > 20  # tree/, budget/ and learner/ figures, the evaluation
        assert {k: got[k] for k in same} == same
    assert _same_tensors_as(run.learner.model, cfg.run_dir / "checkpoint-final")
    for step in (1, 2):
        assert _tree_rows(tmp_path, step) == _tree_rows(cfg.run_dir, step)
    assert [v["step"] for v in load_steps(tmp_path, None, None, every_step=True)] == [1, 2]


def test_a_run_alongside_another_training_gives_the_same_records(
    two_step_run, make_cfg, tiny_cfg, tmp_path, follow_records, two_step_overrides
):
    """Same-machine reproducibility under load: the 2-update run again, while a second training
    (its own Ray instance, in another process) starts and trains beside it on the same cores.
    That one is then stopped with Ctrl-C (SIGINT): it says what it kept and exits, and its Ray
    instance is gone."""
    cfg, summary = two_step_run(learners=1)
    other_runs = tmp_path / "other"
    started: list[OwnRayRun] = []

    def start_other(_controller) -> None:
        """Called once this run's Ray is up (two Ray instances starting at once could race for a
        port): the other training starts while this one starts Ray Train and trains."""
        with _sigint_not_ignored():
            started.append(OwnRayRun(tiny_cfg, other_runs))

    again = make_cfg("name=e2e-again", *two_step_overrides(learners=1))
    try:
        train(again, progress=False, on_start=start_other)
        (other,) = started
        # It was busy all along (start-up, then training; it cannot end before it is stopped),
        # and it is stopped while it trains.
        other.wait_for_first_step(follow_records)
    finally:
        for other in started:
            other.stop(signal.SIGINT)
    expected, got = (_read_records(c.run_dir) for c in (cfg, again))
    assert [_repeatable(r) for r in got] == [_repeatable(r) for r in expected]
    assert _same_tensors(cfg.run_dir / "checkpoint-final", again.run_dir / "checkpoint-final")
    other.assert_stopped_cleanly()


def test_a_local_run_listens_on_loopback_only_and_sigterm_stops_it_as_ctrl_c_does(
    tiny_cfg, tiny_policy, tmp_path, follow_records
):
    """A training that started its own Ray, while it trains: every socket its processes listen
    on (the driver, Ray's daemons and agents, the rollout and learner workers) is bound to the
    loopback interface. Then ``kill`` (SIGTERM): the run says what it kept and exits through its
    cleanup (not killed by Ray's handler, which left the session's workers running), and no
    process of its Ray instance is left."""
    run = OwnRayRun(tiny_cfg, tmp_path)
    try:
        run.wait_for_first_step(follow_records)
        listening = run.listening_addresses()
        assert len(listening) >= 4, listening  # GCS, raylet, a worker, the dashboard at least
        assert all(ip in LOOPBACK for ip, _, _ in listening), listening
    finally:
        run.stop(signal.SIGTERM)
    run.assert_stopped_cleanly()


class OwnRayRun:
    """``treegrpo train`` in a process of its own, starting its own Ray instance under a fresh
    temp dir, on the tests' warm start; it trains until it is stopped."""

    def __init__(self, tiny_cfg, output_dir: Path):
        self.ray_dir = Path(tempfile.mkdtemp(prefix="tgo-", dir="/tmp"))  # socket paths stay short
        self.metrics = output_dir / "tiny-multihop" / "metrics.jsonl"
        overrides = [
            "train.steps=100000",
            "train.eval_every=0",
            f"train.output_dir={output_dir}",
            f"warmstart.steps={tiny_cfg.warmstart.steps}",
            f"warmstart.cache_dir={tiny_cfg.warmstart.cache_dir}",
        ]
        command = [sys.executable, "-m", "treegrpo_ray.commands.cli", "train", "tiny-multihop"]
        command += ["--quiet", *(a for s in overrides for a in ("--set", s))]
        self.process = subprocess.Popen(
            command,
            env={**os.environ, "RAY_TMPDIR": str(self.ray_dir)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ray_processes: list[psutil.Process] = []
        self.stderr = ""

    def wait_for_first_step(self, follow_records) -> None:
        """Wait for its first record; note the processes of its Ray instance."""
        first = next(follow_records(self.metrics, writer_pid=self.process.pid), None)
        assert first is not None, self.process.stderr.read()  # it exited before its first step
        self.ray_processes = _processes_naming(self.ray_dir)
        assert self.ray_processes  # the check after the stop looks where its Ray runs

    def listening_addresses(self) -> list[tuple[str, int, str]]:
        """(address, port, process name) of every socket the run and its descendants listen on."""
        root = psutil.Process(self.process.pid)
        found = []
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                for conn in process.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        found.append((conn.laddr.ip, conn.laddr.port, process.name()))
        return found

    def stop(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)
        try:
            _, self.stderr = self.process.communicate()  # pytest's timeout bounds the wait
        finally:
            if self.process.poll() is None:  # the test failed waiting: no training left behind
                self.process.terminate()

    def assert_stopped_cleanly(self) -> None:
        """It said what it kept, exited as interrupted and left no process of its Ray."""
        stderr = self.stderr[-3000:]
        assert self.process.returncode == 130, stderr
        assert self.stderr.strip().splitlines()[-1].startswith("treegrpo: interrupted; "), stderr
        _, left = psutil.wait_procs(self.ray_processes, timeout=STOPPED_PROCESS_WAIT_S)
        assert not left, [p.info["cmdline"] for p in left]
        shutil.rmtree(self.ray_dir, ignore_errors=True)


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """Children started inside get SIGINT's default action. A shell's background job (``cmd &``)
    starts with SIGINT ignored, exec keeps an ignored signal ignored, and Python then installs
    no KeyboardInterrupt handler: Ctrl-C could not be tested under such a pytest."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # reset to default by exec
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _processes_naming(path: Path) -> list[psutil.Process]:
    """The processes whose command line names ``path`` (a Ray instance's under its temp dir)."""
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if f"{path}/" in " ".join(p.info["cmdline"] or [])
    ]


def _read_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tree_rows(run_dir, step):
    """The saved trees of ``step``: structure, actions and advantages, one dict per node."""
    columns = ["tree_id", "node_id", "parent_id", "action_ids", "advantage", "routed_advantage"]
    return read_saved_trees(run_dir, step)[0].select(columns).to_pylist()


def _repeatable(record):
    return {k: v for k, v in record.items() if not k.startswith(UNREPEATABLE)}


def _same_tensors_as(model, checkpoint):
    saved = load_file(str(checkpoint / "model.safetensors"))
    state = model.state_dict()
    return all(torch.equal(state[k], v) for k, v in saved.items())


def _same_tensors(a, b):
    return _close_tensors(a, b, atol=0.0)


def _close_tensors(a, b, atol):
    first, second = (load_file(str(d / "model.safetensors")) for d in (a, b))
    return first.keys() == second.keys() and all(
        torch.allclose(first[k], second[k], rtol=0.0, atol=atol) for k in first
    )


def test_trees_over_the_token_budget_are_split_and_trained(make_cfg, tiny_policy):
    """In process (the learner is the Ray job's: ``test_the_in_process_loop_reproduces_the_ray_job``
    shows the records are the same)."""
    # The step's four trees hold 60, 60, 138 and 208 tokens and their longest path 80 (measured
    # on the tests' warm start): a budget of 100 splits the two large trees.
    cfg = make_cfg("name=split-trees", "ppo.micro_batch_tokens=100", "train.prompts_per_step=2")
    run = LocalRun(cfg, resolve_model_path(cfg, progress=False))
    record = run.step()

    assert record["learner/split_trees"] > 0 and record["learner/split_extra_tokens"] > 0
    assert record["learner/tokens_forwarded"] == (
        record["learner/tokens"] + record["learner/split_extra_tokens"]
    )
    assert record["learner/skipped_updates"] == 0
    assert not _same_tensors_as(run.learner.model, Path(tiny_policy))


def test_a_path_over_the_token_budget_stops_the_run_with_a_checkpoint(make_cfg, tmp_path, capsys):
    cfg = make_cfg(
        "name=over-budget",
        "ppo.micro_batch_tokens=32",  # shorter than any root-to-leaf path of this task
        "train.steps=1",
        "train.prompts_per_step=2",
        "train.final_eval_questions=8",
    )
    config_file = tmp_path / "over-budget.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))

    assert main(["train", str(config_file), "--quiet"]) == 1
    # Ray Train finished before Ray was shut down: no thread of this run outlives its session
    assert FIT_THREAD not in [t.name for t in threading.enumerate()]

    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("treegrpo: training stopped: tree ")
    assert "has a root-to-leaf path of " in message and "ppo.micro_batch_tokens is 32" in message
    assert "raise ppo.micro_batch_tokens to at least " in message
    assert "treegrpo train --resume" in message
    assert (cfg.run_dir / "checkpoint-last-good" / "model.safetensors").is_file()
    assert (cfg.run_dir / "checkpoints" / "latest").read_text().strip() == "step-000000"
    # What the message proposes is a valid resume (test_resume_... runs one end to end).
    resumed = resume_config(cfg.run_dir, None, ["ppo.micro_batch_tokens=512"])
    assert resumed.ppo.micro_batch_tokens == 512 and resume_step(resumed) == 0


def test_a_checkpoint_the_disk_cannot_hold_stops_the_run_in_one_line(
    tiny_cfg, two_step_overrides, small_disk, capsys
):
    """The run's output on a 3 MB tmpfs: its small files fit, its first checkpoint (~6 MB)
    does not. torch.save reports a full disk as a RuntimeError without errno."""
    out = small_disk(3 << 20)
    sets = [
        *two_step_overrides(),
        f"train.output_dir={out}",
        f"warmstart.steps={tiny_cfg.warmstart.steps}",
        f"warmstart.cache_dir={tiny_cfg.warmstart.cache_dir}",
    ]
    args = ["train", "tiny-multihop", "--quiet"] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    run = out / "tiny-multihop"
    assert line.startswith(
        f"treegrpo: training stopped: checkpoint {run / 'checkpoints' / 'step-000001'} "
        "could not be written: "
    )
    assert "bytes free)" in line and f"{run} holds no checkpoint yet" in line
    assert list((run / "checkpoints").iterdir()) == []  # nothing of it left
