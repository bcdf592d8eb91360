"""Shared fixtures: a briefly warm-started tiny policy (built once per session)."""

from __future__ import annotations

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
