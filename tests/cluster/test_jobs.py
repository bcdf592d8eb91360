"""`treegrpo submit | status | logs | stop` against a real two-node Ray cluster with token auth."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from treegrpo_ray.commands.cli import main

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
RUN_NAME = "jobs-e2e"
STEPS = 3


def _cli(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _cli_process(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh process with exactly ``env`` (plus PATH)."""
    env = {"PATH": os.environ["PATH"], **env}
    command = [sys.executable, "-m", "treegrpo_ray.commands.cli", *args]
    return subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("treegrpo: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def with_token(ray_cluster, monkeypatch):
    """The client environment Ray documents: RAY_AUTH_MODE=token and the token's file."""
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in ray_cluster.client_env().items():
        monkeypatch.setenv(name, value)
    return ray_cluster


@dataclass
class FinishedJob:
    """A tiny training job run to its end."""

    job: str
    log: str  # output of `treegrpo logs --follow`
    run_dir: Path


def _job_overrides(tiny_cfg, steps: int, output_dir: Path) -> list[str]:
    """`--set` arguments of a tiny job on the two-node cluster, warm start from ``tiny_policy``."""
    overrides = [
        f"train.steps={steps}",
        "train.prompts_per_step=2",
        "train.eval_every=0",
        "train.final_eval_questions=8",
        f"warmstart.steps={tiny_cfg.warmstart.steps}",
        f"warmstart.cache_dir={tiny_cfg.warmstart.cache_dir}",  # tiny_policy is cached there
        f"train.output_dir={output_dir}",
        "cluster.torch_threads=1",
        # Two rollout workers fit on the rollout node (1 CPU, rollout_node: 1) after scaling.
        "cluster.rollout_resources={rollout_node: 0.5}",
        "cluster.learner_resources={learner_node: 1}",
        "cluster.rollout_cpus=0.5",
        "cluster.learner_cpus=0.5",
    ]
    return [arg for override in overrides for arg in ("--set", override)]


def _submit(name: str, sets: list[str], url: str) -> str:
    """Submit a tiny-multihop job named ``name``; returns its job id."""
    submit = ["submit", "tiny-multihop", "--name", name, "--working-dir", str(REPO)]
    submitted = _cli(*submit, *sets, "--address", url)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.split()[1]  # "submitted ID to URL"
    assert job.startswith(f"treegrpo-{name}-")
    assert f"treegrpo logs {job} --follow --address {url}" in submitted.stdout
    return job


@pytest.fixture(scope="module")
def finished_job(ray_cluster, tiny_cfg, tiny_policy, tmp_path_factory) -> FinishedJob:
    output_dir = tmp_path_factory.mktemp("job-runs")
    url = ray_cluster.dashboard_url
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAY_ADDRESS", raising=False)
        for name, value in ray_cluster.client_env().items():
            env.setenv(name, value)
        job = _submit(RUN_NAME, _job_overrides(tiny_cfg, STEPS, output_dir), url)
        # Returns when the job has ended (the log stream closes); pytest's timeout bounds it.
        followed = _cli("logs", job, "--follow", "--address", url)
    assert followed.returncode == 0, followed.stderr
    return FinishedJob(job, followed.stdout, output_dir / RUN_NAME)


@pytest.mark.timeout(1500)
def test_submitted_job_trains_on_both_nodes(finished_job, with_token):
    job, log, run_dir = finished_job.job, finished_job.log, finished_job.run_dir
    url = with_token.dashboard_url

    status = _cli("status", job, "--address", url)
    assert status.returncode == 0
    assert status.stdout.startswith(f"{job}: SUCCEEDED"), (status.stdout, log[-5000:])
    listed = _cli("status", "--address", url)
    assert any(
        line.split()[:3] == [job, "SUCCEEDED", f"run={RUN_NAME}"]
        for line in listed.stdout.splitlines()
    ), listed.stdout

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    placement = summary["placement"]  # the node ids of the rollout workers and learners
    assert set(placement["rollout"]) == {with_token.node_ids["rollout_node"]}
    assert set(placement["learner"]) == {with_token.node_ids["learner_node"]}


@pytest.mark.timeout(1500)
def test_logs_print_the_summary_line(finished_job, with_token):
    job, followed, run_dir = finished_job.job, finished_job.log, finished_job.run_dir
    logs = _cli("logs", job, "--address", with_token.dashboard_url)
    assert logs.returncode == 0, logs.stderr
    for output in (logs.stdout, followed):
        summary_line = [line for line in output.splitlines() if line.startswith("treegrpo: ")]
        assert summary_line, output[-5000:]
        assert summary_line[-1].startswith(f"treegrpo: {RUN_NAME} done in")
        assert summary_line[-1].endswith(str(run_dir))


def _record_after(records, after_step: int, workers: float) -> dict:
    """The first record after step ``after_step`` that the learner wrote with ``workers``
    rollout workers (pytest's timeout bounds the wait: the job trains far more steps than this
    test watches)."""
    return next(r for r in records if r["step"] > after_step and r["rollout/workers"] == workers)


@pytest.mark.timeout(900)
def test_scale_resizes_a_training_job_then_stop_ends_it(
    with_token, tiny_cfg, tiny_policy, tmp_path, follow_records
):
    url, name = with_token.dashboard_url, "jobs-scale"
    # Many more steps than the test watches: it stops the job once it has seen both sizes.
    job = _submit(name, _job_overrides(tiny_cfg, 100_000, tmp_path), url)
    metrics = tmp_path / name / "metrics.jsonl"

    # Scaling right after submitting waits for the job's controller to start.
    up = _cli("scale", job, "--rollout-workers", "2", "--address", url)
    assert up.returncode == 0, up.stderr
    reply = re.fullmatch(
        rf"{job}: 2 rollout workers \(policy version (\d+); 1 added, on versions \[(\d+)\]\)",
        up.stdout.strip(),
    )
    assert reply, up.stdout
    version, added_on = int(reply[1]), int(reply[2])
    # The new worker loads the newest policy when it is added; a job that is already training
    # may publish another version while the worker is placed, before the reply.
    assert added_on <= version
    records = follow_records(metrics)
    grown = _record_after(records, version, workers=2.0)

    down = _cli("scale", name, "--rollout-workers", "1", "--address", url)  # by run name
    assert down.returncode == 0, down.stderr
    assert down.stdout.startswith(f"{name}: 1 rollout workers (policy version ")
    shrunk = _record_after(records, grown["step"], workers=1.0)

    stopped = _cli("stop", job, "--address", url)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"{job}: stop requested")
    assert _cli("logs", job, "--follow", "--address", url).returncode == 0  # returns at the end
    assert _cli("status", job, "--address", url).stdout.startswith(f"{job}: STOPPED")
    assert "was not running" in _cli("stop", job, "--address", url).stdout

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(records) + 1))  # no update lost or repeated by scaling
    assert shrunk["step"] > grown["step"] > version


def test_missing_token_is_one_line(ray_cluster, tmp_path):
    url = ray_cluster.dashboard_url
    no_token = {"HOME": str(tmp_path)}  # no RAY_* variables, no ~/.ray/auth_token
    result = _cli_process(no_token, "status", "--address", url)
    _assert_one_line_error(result, "auth token missing", url, "RAY_AUTH_TOKEN")

    result = _cli_process({**no_token, "RAY_AUTH_MODE": "token"}, "status", "--address", url)
    _assert_one_line_error(result, "auth token missing", "RAY_AUTH_TOKEN_PATH")


def test_wrong_token_is_rejected_in_one_line(ray_cluster, tmp_path):
    url = ray_cluster.dashboard_url
    wrong = {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
    result = _cli_process(wrong, "status", "--address", url)
    _assert_one_line_error(result, "auth token rejected", url, "from RAY_AUTH_TOKEN")


def test_token_variable_alone_is_enough(ray_cluster, tmp_path):
    """Ray's own client also needs RAY_AUTH_MODE=token; ours sends an explicitly given token."""
    env = {"HOME": str(tmp_path), "RAY_AUTH_TOKEN": ray_cluster.token}
    result = _cli_process(env, "status", "--address", ray_cluster.dashboard_url)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("command", ["status", "logs", "stop"])
def test_unknown_job_is_one_line(with_token, command):
    url = with_token.dashboard_url
    result = _cli(command, "treegrpo-no-such-job", "--address", url)
    _assert_one_line_error(
        result, "no job treegrpo-no-such-job", f"treegrpo status --address {url}"
    )


def test_unreachable_address_is_one_line(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{s.getsockname()[1]}"
    _assert_one_line_error(_cli("status", "--address", address), "cannot reach", address)
    malformed = "http://127.0.0.1:99999"
    _assert_one_line_error(_cli("status", "--address", malformed), "Port out of range", malformed)
    monkeypatch.setenv("RAY_ADDRESS", address)
    _assert_one_line_error(_cli("logs", "some-job"), address, "--address", "RAY_ADDRESS")


def test_job_commands_and_the_scaler_load_no_torch():
    """`status`, `logs`, `stop` and the short job `scale` submits answer in a second or two: they
    import neither torch nor transformers (each costs seconds to import)."""
    probe = (
        "import sys\n"
        "import treegrpo_ray.commands.scale\n"
        "from treegrpo_ray.commands.cli import main\n"
        "code = main(['status', '--address', 'http://127.0.0.1:1'])\n"
        "print(code, sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.stdout.strip() == "2 []", (result.stdout, result.stderr)


def test_bad_submissions_fail_before_reaching_the_cluster(with_token, tmp_path):
    url = with_token.dashboard_url
    before = _cli("status", "--address", url).stdout
    result = _cli("submit", "tiny-multihop", "--set", "tree.mm=4", "--address", url)
    _assert_one_line_error(result, "unknown field 'tree.mm'")
    outside = tmp_path / "mine.yaml"
    outside.write_text("train: {steps: 1}\n")
    result = _cli("submit", str(outside), "--working-dir", str(REPO), "--address", url)
    _assert_one_line_error(result, f"config file {outside} is outside the working directory")
    assert _cli("status", "--address", url).stdout == before


def test_scale_to_zero_or_a_job_that_is_not_running_is_one_line(with_token):
    url = with_token.dashboard_url
    before = _cli("status", "--address", url).stdout
    result = _cli("scale", "some-run", "--rollout-workers", "0", "--address", url)
    _assert_one_line_error(result, "--rollout-workers must be at least 1, got 0")
    result = _cli("scale", "no-such-run", "--rollout-workers", "2", "--address", url)
    _assert_one_line_error(result, "no running treegrpo job named no-such-run")
    assert _cli("status", "--address", url).stdout == before  # treegrpo jobs untouched


def _train_on(
    ray_cluster, tiny_cfg, out, *sets: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`treegrpo train tiny-multihop` against the test cluster with the tests' warm start."""
    sets = (
        *sets,
        f"cluster.address={ray_cluster.gcs_address}",
        f"train.output_dir={out}",
        f"warmstart.steps={tiny_cfg.warmstart.steps}",
        f"warmstart.cache_dir={tiny_cfg.warmstart.cache_dir}",
    )
    args = ["train", "tiny-multihop", "--quiet"] + [a for s in sets for a in ("--set", s)]
    return _cli_process(ray_cluster.client_env(), *args, timeout=timeout)


def test_a_config_larger_than_the_cluster_is_refused_before_anything_starts(
    ray_cluster, tiny_cfg, tiny_policy, tmp_path
):
    sets = ["cluster.rollout_workers=4", "train.prompts_per_step=4"]
    result = _train_on(ray_cluster, tiny_cfg, tmp_path, *sets)
    _assert_one_line_error(result, "asks for 5 CPU", "the Ray cluster has 2", "add nodes")
    assert not (tmp_path / "tiny-multihop").exists()


def test_a_learner_rank_needing_more_gpus_than_any_node_has_is_refused_with_the_arithmetic(
    ray_cluster, tiny_cfg, tiny_policy, tmp_path
):
    """Each node declares 2 GPUs (4 in all): 3 for one learner rank pass the total but no node
    holds them, and Ray would wait for them forever."""
    result = _train_on(ray_cluster, tiny_cfg, tmp_path, "cluster.learner_gpus=3")
    _assert_one_line_error(
        result,
        "cannot be placed: learner rank 0: needs 3 GPU(s) on one node",
        "nodes have 2, 2 GPUs",
        "cluster.learner_gpus",
    )
    assert not (tmp_path / "tiny-multihop").exists()


# A job on the simulated GPUs (each node declares 2 it lacks): Ray places and accounts them, the
# work runs on CPUs (cluster.simulated_gpus). A learner rank holds one node's 2 GPUs.
SIMULATED = (
    "cluster.simulated_gpus=true",
    "cluster.learner_gpus=2",
    "cluster.learner_cpus=0.5",
    "cluster.rollout_cpus=0.5",
    "cluster.torch_threads=1",
    "train.prompts_per_step=2",
    "train.eval_every=0",
    "train.final_eval_questions=4",
)


@pytest.mark.timeout(900)
def test_learner_ranks_take_the_gpus_of_both_nodes_and_train(
    ray_cluster, tiny_cfg, tiny_policy, tmp_path
):
    sets = (*SIMULATED, "cluster.learner_workers=2", "train.steps=1")
    result = _train_on(ray_cluster, tiny_cfg, tmp_path, *sets, timeout=600)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "tiny-multihop" / "summary.json").read_text())
    assert sorted(summary["placement"]["learner"]) == sorted(ray_cluster.node_ids.values())
    assert summary["steps"] == 1


@pytest.mark.timeout(900)
def test_a_tensor_parallel_engine_takes_a_node_and_scaling_past_the_gpus_is_refused_at_once(
    with_token, tiny_cfg, tiny_policy, tmp_path, follow_records
):
    """vLLM with TP = 2 (the embedded engine standing in): its two GPUs are one bundle on one
    node, the learner's two the other node's. A second engine would need 2 more GPUs: refused
    at once, with the arithmetic; the job trains on."""
    url, name = with_token.dashboard_url, "jobs-gpus"
    engine = ("engine.kind=vllm", "engine.vllm.device=cuda", "engine.vllm.tensor_parallel_size=2")
    sets = [a for s in (*SIMULATED, *engine) for a in ("--set", s)]
    job = _submit(name, _job_overrides(tiny_cfg, 100_000, tmp_path) + sets, url)
    records = follow_records(tmp_path / name / "metrics.jsonl")
    first = next(records)

    refused = _cli("scale", job, "--rollout-workers", "2", "--address", url)
    _assert_one_line_error(
        refused,
        "1 more rollout worker(s) need 2 GPU (2 each) but the cluster has 4 and this job holds 4",
        "0 left",
    )
    later = next(r for r in records if r["step"] > first["step"])
    assert later["rollout/workers"] == 1.0
    # the engine's group: two one-GPU bundles, packed on the rollout node
    engines = [
        g["bundles"]
        for g in _placement_groups(with_token)
        if g["state"] == "CREATED" and len(g["bundles"]) == 2
    ]
    assert len(engines) == 1
    assert [b["unit_resources"].get("GPU") for b in engines[0]] == [1, 1]
    assert {b["node_id"] for b in engines[0]} == {with_token.node_ids["rollout_node"]}

    assert _cli("stop", job, "--address", url).returncode == 0
    assert _cli("logs", job, "--follow", "--address", url).returncode == 0  # returns at the end


def _placement_groups(cluster) -> list[dict]:
    """The cluster's placement groups, from Ray's state API (bundles with their nodes)."""
    reply = requests.get(
        f"{cluster.dashboard_url}/api/v0/placement_groups",
        params={"detail": "1"},
        headers=cluster.auth_headers(),
        timeout=10,
    )
    reply.raise_for_status()
    return reply.json()["data"]["result"]["result"]


# Four scale jobs and two worker starts beside a job training flat out: ~4 min on an idle 2-core
# machine, past 15 min with both cores busy (a guard against a hang, not a speed bound)
@pytest.mark.timeout(2400)
def test_single_gpu_engines_scale_up_to_the_free_gpus_and_down_again(
    with_token, tiny_cfg, tiny_policy, tmp_path, follow_records
):
    """vLLM on one GPU each (the embedded engine standing in) on the rollout node's 2 GPUs, the
    learner on the head's 2: a second engine takes the last GPU, a third is refused at once;
    scaling down frees a GPU that the next scale-up takes again."""
    url, name = with_token.dashboard_url, "jobs-gpu-scale"
    engine = ("engine.kind=vllm", "engine.vllm.device=cuda")
    sets = [a for s in (*SIMULATED, *engine) for a in ("--set", s)]
    job = _submit(name, _job_overrides(tiny_cfg, 100_000, tmp_path) + sets, url)
    records = follow_records(tmp_path / name / "metrics.jsonl")
    next(records)

    assert _cli("scale", job, "--rollout-workers", "2", "--address", url).returncode == 0
    refused = _cli("scale", job, "--rollout-workers", "3", "--address", url)
    _assert_one_line_error(refused, "this job holds 4 with 2 rollout worker(s): 0 left")
    down = _cli("scale", job, "--rollout-workers", "1", "--address", url)
    assert down.stdout.startswith(f"{job}: 1 rollout workers"), down.stderr
    again = _cli("scale", job, "--rollout-workers", "2", "--address", url)
    assert again.stdout.startswith(f"{job}: 2 rollout workers"), again.stderr

    assert _cli("stop", job, "--address", url).returncode == 0
    assert _cli("logs", job, "--follow", "--address", url).returncode == 0  # returns at the end
