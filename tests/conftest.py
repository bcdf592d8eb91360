"""Shared fixtures: a briefly warm-started tiny policy (built once per session), and a reader
that blocks on a run's ``metrics.jsonl`` records as they are written."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from treegrpo_ray.config import JobConfig, load_config

# Enough supervised steps for well-formed actions and some correct answers; far from converged.
TEST_WARMSTART_STEPS = 150


@pytest.fixture(scope="session")
def make_cfg(tmp_path_factory):
    """``make_cfg(*overrides)``: the tiny-multihop preset with test paths and the overrides."""
    root = tmp_path_factory.mktemp("treegrpo")
    base = [
        f"warmstart.cache_dir={root / 'warmstart'}",
        f"warmstart.steps={TEST_WARMSTART_STEPS}",
        f"train.output_dir={root / 'runs'}",
    ]

    def make(*overrides: str) -> JobConfig:
        return load_config("tiny-multihop", base + list(overrides))

    return make


@pytest.fixture(scope="session")
def tiny_cfg(make_cfg) -> JobConfig:
    return make_cfg()


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg) -> str:
    """Path of the tiny model warm-started for the tests."""
    from treegrpo_ray.cluster.train import resolve_model_path

    return resolve_model_path(tiny_cfg, progress=False)


@pytest.fixture
def follow_records() -> Iterator:
    """``follow_records(metrics, writer_pid=None)``: yields each record of ``metrics.jsonl`` as
    the run writes it, from the first; blocks until the next one (``tail -F``, woken by the file
    changing, not by a timer). With ``writer_pid`` the records end when that process exits;
    otherwise pytest's timeout bounds the wait."""
    followers: list[subprocess.Popen] = []

    def follow(metrics: Path, writer_pid: int | None = None) -> Iterator[dict]:
        command = ["tail", "-F", "-n", "+1", str(metrics)]
        if writer_pid is not None:
            command[1:1] = [f"--pid={writer_pid}"]
        tail = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        followers.append(tail)
        for line in tail.stdout:
            yield json.loads(line)

    yield follow
    for tail in followers:
        tail.kill()
        tail.wait()
