"""The test tiers, and shared fixtures: a briefly warm-started tiny policy (built once per
session), a tiny policy in a Hugging Face cache under a Hub id, and a reader that blocks on a
run's ``metrics.jsonl`` records as they are written.

Tiers: ``pytest`` runs the fast tier (unmarked tests: pure maths, engines and learners on small
untrained models, in-process); ``@pytest.mark.ray`` tests start or join a Ray cluster and
``@pytest.mark.slow`` ones use a warm-started or real model, vLLM, a GPU or a whole install.
``pytest --tier ray,slow`` picks tiers, ``--tier all`` runs every one (the README's command).
A test that starts Ray without ``ray``, or uses a warm-started policy, vLLM, a GPU or the real
model without a tier marker, fails and says which marker it needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest

from treegrpo_ray.config import JobConfig, TinyModelConfig, load_config
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.modeling import build_tiny_model, build_word_tokenizer

if TYPE_CHECKING:  # torch loads after the package, which sets libgomp's environment first
    import torch

# Enough supervised steps for well-formed actions and some correct answers; far from converged.
TEST_WARMSTART_STEPS = 150

TIERS = ("fast", "ray", "slow")
# Markers saying what a test needs that the fast tier does not give it.
NEEDS_A_TIER = ("gpu", "vllm", "realmodel")
# Fixtures holding a warm-started policy, and fixtures holding a Ray cluster.
WARM_FIXTURES = ("tiny_policy",)
RAY_FIXTURES = ("local_ray", "ray_cluster", "engine_hosts")
LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        default="fast",
        help="comma-separated tiers to run: fast (the default), ray, slow, or all",
    )


def chosen_tiers(config: pytest.Config) -> set[str]:
    asked = {name.strip() for name in config.getoption("--tier").split(",") if name.strip()}
    if "all" in asked:
        return set(TIERS)
    unknown = asked - set(TIERS)
    if unknown or not asked:
        raise pytest.UsageError(
            f"--tier {config.getoption('--tier')}: the tiers are {', '.join(TIERS)} or all"
        )
    return asked


def tier_of(item: pytest.Item) -> str:
    if item.get_closest_marker("ray"):
        return "ray"
    return "slow" if item.get_closest_marker("slow") else "fast"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = chosen_tiers(config)
    left_out = [item for item in items if tier_of(item) not in tiers]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if tier_of(item) in tiers]
    config.stash[LEFT_OUT] = len(left_out)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    left_out = config.stash.get(LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"tiers run: {config.getoption('--tier')}; {left_out} tests of other tiers left out "
            "(--tier all runs every tier: the README's test command)"
        )


def ray_sessions() -> set[str]:
    """Names of the Ray session directories on this machine (where Ray writes them)."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    root = Path(base) / "ray"
    return {p.name for p in root.glob("session_2*")} if root.is_dir() else set()


class WarmStartUse:
    """Counts calls of the warm starts ``resolve_model_path`` makes (cached or not)."""

    calls = 0

    @classmethod
    def wrap(cls, function):
        def counted(*args, **kwargs):
            cls.calls += 1
            return function(*args, **kwargs)

        return counted


@pytest.fixture(scope="session", autouse=True)
def count_warm_starts() -> Iterator[None]:
    from treegrpo_ray.learners import policies

    originals = policies.warm_start, policies.protocol_warm_start
    policies.warm_start, policies.protocol_warm_start = map(WarmStartUse.wrap, originals)
    yield
    policies.warm_start, policies.protocol_warm_start = originals


SESSIONS_BEFORE = pytest.StashKey[set[str]]()
WARM_CALLS_BEFORE = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[SESSIONS_BEFORE] = ray_sessions()
    item.stash[WARM_CALLS_BEFORE] = WarmStartUse.calls
    tier, uses = tier_of(item), set(getattr(item, "fixturenames", ()))
    needs = [name for name in NEEDS_A_TIER if item.get_closest_marker(name)]
    needs += sorted(uses.intersection(WARM_FIXTURES))
    if needs and tier == "fast":
        pytest.fail(f"{item.nodeid} needs {needs[0]}: mark it @pytest.mark.slow", pytrace=False)
    if uses.intersection(RAY_FIXTURES) and tier != "ray":
        pytest.fail(f"{item.nodeid} uses a Ray cluster: mark it @pytest.mark.ray", pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Fails (as a teardown error) a test that did what its tier does not allow."""
    tier = tier_of(item)
    started = ray_sessions() - item.stash[SESSIONS_BEFORE]
    if started and tier != "ray":
        pytest.fail(f"{item.nodeid} started Ray: mark it @pytest.mark.ray", pytrace=False)
    warmed = WarmStartUse.calls > item.stash[WARM_CALLS_BEFORE]
    if warmed and tier == "fast":
        pytest.fail(
            f"{item.nodeid} uses a warm-started policy: mark it @pytest.mark.slow", pytrace=False
        )


@pytest.fixture(scope="session")
def make_cfg(tmp_path_factory):
    """``make_cfg(*overrides, preset="tiny-multihop")``: the preset with test paths and the
    overrides."""
    root = tmp_path_factory.mktemp("treegrpo")
    base = [
        f"warmstart.cache_dir={root / 'warmstart'}",
        f"warmstart.steps={TEST_WARMSTART_STEPS}",
        f"train.output_dir={root / 'runs'}",
    ]

    def make(*overrides: str, preset: str = "tiny-multihop") -> JobConfig:
        return load_config(preset, base + list(overrides))

    return make


def two_steps(learners: int = 1) -> list[str]:
    """Overrides of a 2-update run on 4 prompts per update, evaluated and checkpointed at each."""
    return [
        f"cluster.learner_workers={learners}",
        f"cluster.torch_threads={3 - learners}",  # one thread per core
        "train.steps=2",
        "train.prompts_per_step=4",
        "train.eval_every=1",
        "train.eval_questions=16",
        "train.final_eval_questions=16",
        "train.checkpoint_every=1",
    ]


@pytest.fixture(scope="session")
def two_step_overrides():
    """``two_step_overrides(learners=1)``: see ``two_steps``."""
    return two_steps


def fill_lora_b(model: torch.nn.Module, scale: float = 0.1, seed: int = 0) -> None:
    """Every LoRA B matrix of peft ``model`` set to seeded normal values times ``scale``: peft
    starts B at zero, so an untrained adapter changes neither outputs nor input gradients."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))


@pytest.fixture(scope="session")
def nonzero_lora_b():
    """``nonzero_lora_b(model, scale=0.1, seed=0)``: see ``fill_lora_b``."""
    return fill_lora_b


@pytest.fixture(scope="session")
def tiny_cfg(make_cfg) -> JobConfig:
    return make_cfg()


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg) -> str:
    """Path of the tiny model warm-started for the tests."""
    from treegrpo_ray.learners.policies import resolve_model_path

    return resolve_model_path(tiny_cfg, progress=False)


class HubPolicy(NamedTuple):
    """A policy stored in a Hugging Face cache under a Hub id."""

    repo_id: str
    cache: Path  # what HF_HUB_CACHE points at
    snapshot: Path  # the directory the id resolves to


def write_hub_snapshot(model_dir: Path, cache: Path, repo_id: str) -> Path:
    """Store a ``save_pretrained`` directory in a Hugging Face cache as ``hf download`` lays it out:
    ``models--Org--Name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` symlinks to the blobs and
    ``refs/main`` holding the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in files:
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="session")
def untrained_policy(tmp_path_factory, tiny_cfg) -> str:
    """Path of an untrained tiny multihop policy of the preset's size (the fast tier's policy:
    its actions are noise, its shapes and maths are the warm-started one's)."""
    model_dir = tmp_path_factory.mktemp("untrained") / "policy"
    tokenizer = build_word_tokenizer(MultihopTask(tiny_cfg.task.multihop).vocabulary(), model_dir)
    build_tiny_model(tiny_cfg.model.tiny, len(tokenizer), seed=0).save_pretrained(str(model_dir))
    return str(model_dir)


@pytest.fixture(scope="session")
def hub_policy(tmp_path_factory, tiny_cfg) -> HubPolicy:
    """An untrained one-layer tiny multihop policy, cached as ``treegrpo-test/tiny-multihop``."""
    root = tmp_path_factory.mktemp("hub")
    model_dir = root / "model"
    vocabulary = MultihopTask(tiny_cfg.task.multihop).vocabulary()
    tokenizer = build_word_tokenizer(vocabulary, model_dir)
    model = build_tiny_model(TinyModelConfig(num_layers=1), len(tokenizer), seed=0)
    model.save_pretrained(str(model_dir))
    repo_id = "treegrpo-test/tiny-multihop"
    cache = root / "cache"
    return HubPolicy(repo_id, cache, write_hub_snapshot(model_dir, cache, repo_id))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A one-CPU local Ray for a test module, or the one an earlier module left running."""
    import ray

    from treegrpo_ray.cluster.local_ray import init_local_ray

    started = not ray.is_initialized()
    if started:
        init_local_ray(
            num_cpus=1, include_dashboard=False, namespace="treegrpo-test", log_to_driver=False
        )
    yield
    if started:
        ray.shutdown()


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


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(nbytes)``: a directory on a tmpfs of that size, mounted for the test (needs
    root and mount(8); skipped with the reason where they are missing)."""
    import os
    import shutil
    import subprocess

    mounts = []

    def make(nbytes: int):
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("a size-limited tmpfs needs root and mount(8)")
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", str(where)], check=False)
