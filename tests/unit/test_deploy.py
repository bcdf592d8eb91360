"""The deploy files in cluster/deploy/ agree with Ray's schema, the CLI and the run config.

Nothing is launched: the cluster-launcher YAML is validated against the JSON schema that ships
with Ray, the RayJob entrypoint is parsed by the real ``treegrpo`` parser and its config loaded
with the real loader, and both clusters must advertise the custom resources (and GPUs) that the
loaded config's rollout and learner pools ask for.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import ray
import yaml

from treegrpo_ray.commands.cli import _parser
from treegrpo_ray.config import JobConfig, load_config
from treegrpo_ray.errors import UserInputError

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "cluster" / "deploy"
GPU_CONFIG = DEPLOY / "gpu-cluster.yaml"
LAUNCHER = DEPLOY / "cluster.yaml"
RAYJOB = DEPLOY / "rayjob.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
# Ray's own resources; everything else a node advertises is a custom (placement) resource.
BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
SHELL_OPERATORS = {";", "&&", "||", "|", "&"}


def _read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _custom(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if k not in BUILTIN_RESOURCES}


@dataclass(frozen=True)
class Pool:
    """What one worker of a pool asks Ray for, and how many workers the config starts."""

    name: str
    resources: dict[str, float]
    gpus: float
    workers: int

    def per_node(self, node: dict[str, float]) -> int:
        """How many workers of this pool fit on a node that advertises ``node``."""
        fits = [node.get(k, 0) // amount for k, amount in self.resources.items() if amount > 0]
        if self.gpus > 0:
            fits.append(node.get("GPU", 0) // self.gpus)
        return int(min(fits)) if fits else 0


def _pools(cfg: JobConfig) -> list[Pool]:
    c = cfg.cluster
    return [
        Pool("rollout", dict(c.rollout_resources), cfg.engine.rollout_gpus(), c.rollout_workers),
        Pool("learner", dict(c.learner_resources), c.learner_gpus, c.learner_workers),
    ]


def _pool_hosts(pool: Pool, nodes: dict[str, dict[str, float]]) -> str:
    """The one node type / group whose custom resources are exactly those the pool asks for."""
    hosts = [name for name, res in nodes.items() if set(_custom(res)) == set(pool.resources)]
    assert len(hosts) == 1, f"{pool.name} pool ({pool.resources}) is served by {hosts}"
    return hosts[0]


def _simple_commands(command: str) -> list[tuple[dict[str, str], list[str]]]:
    """Split a shell command line into simple commands: (leading VAR=value assignments, argv)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in SHELL_OPERATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    result = []
    for words in filter(None, commands):
        env = {}
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        result.append((env, words))
    return result


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _container_repo() -> PurePosixPath:
    """Where cluster/deploy/Dockerfile puts this checkout in the image."""
    workdirs = re.findall(r"^WORKDIR\s+(\S+)", DOCKERFILE.read_text(), flags=re.M)
    assert len(workdirs) == 1, workdirs
    return PurePosixPath(workdirs[0])


def _entrypoint_config(entrypoint: str) -> tuple[list[str], JobConfig]:
    """Parse a RayJob entrypoint as the job would run it and load the config it names."""
    argv = shlex.split(entrypoint)
    # KubeRay's submitter runs the entrypoint through a shell, `ray job submit` joins the words
    # with spaces and the job supervisor runs that line through a shell again: the words must
    # survive the second split unchanged (no quoted values with spaces).
    assert shlex.split(" ".join(argv)) == argv, f"entrypoint words change when re-split: {argv}"
    args = _parser().parse_args(argv[1:])
    assert args.command == "train", argv
    config = PurePosixPath(args.config)
    if config.is_absolute():
        # a path inside the image: map it back to this checkout
        container_repo = _container_repo()
        assert config.is_relative_to(container_repo), f"{config} is not under {container_repo}"
        config = PurePosixPath(REPO) / config.relative_to(container_repo)
    return argv, load_config(str(config), args.overrides)


@pytest.fixture(scope="module")
def gpu_cfg() -> JobConfig:
    return load_config(str(GPU_CONFIG))


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    return _read_yaml(RAYJOB)


def test_gpu_config_places_pools_on_separate_gpu_nodes(gpu_cfg):
    assert gpu_cfg.engine.kind == "vllm"
    assert gpu_cfg.cluster.learner_gpus > 0
    assert gpu_cfg.cluster.address, "a job must join the cluster, not start a local Ray"
    rollout, learner = _pools(gpu_cfg)
    assert rollout.resources and learner.resources
    assert not set(rollout.resources) & set(learner.resources)
    # both paths are node paths: the model must be on every node, the runs on shared storage
    assert PurePosixPath(gpu_cfg.model.path).is_absolute()
    assert PurePosixPath(gpu_cfg.train.output_dir).is_absolute()


# --- cluster launcher ----------------------------------------------------------------------------


def test_launcher_config_matches_rays_schema():
    config = _read_yaml(LAUNCHER)
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]


def test_launcher_node_types_serve_the_pools(gpu_cfg):
    config = _read_yaml(LAUNCHER)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]["resources"]
    assert not _custom(head) and not head.get("GPU"), "nothing may be placed on the head"
    workers = {
        name: t["resources"] for name, t in types.items() if name != config["head_node_type"]
    }
    pools = _pools(gpu_cfg)
    advertised = set().union(*(_custom(r) for r in workers.values()))
    assert advertised == set().union(*(p.resources for p in pools))
    for pool in pools:
        host = _pool_hosts(pool, workers)
        capacity = types[host].get("min_workers", 0) * pool.per_node(workers[host])
        assert capacity >= pool.workers, f"{host} starts room for {capacity} {pool.name} workers"


def test_launcher_installs_the_package_and_starts_ray_with_local_dashboard(gpu_cfg):
    config = _read_yaml(LAUNCHER)
    # the checkout that `ray up` runs in is synced to one remote directory
    remote_repo = [r for r, local in config["file_mounts"].items() if local == "."]
    assert len(remote_repo) == 1 and (REPO / "pyproject.toml").is_file()
    setup = [c for line in config["setup_commands"] for c in _simple_commands(line)]
    argvs = [argv for _, argv in setup]
    assert ["cd", remote_repo[0]] in argvs
    installs = [a for a in argvs if a[-3:-1] == ["install", "-e"]]
    assert len(installs) == 1 and installs[0][-1].startswith(".["), installs
    extras = set(installs[0][-1].removeprefix(".[").removesuffix("]").split(","))
    assert "gpu" in extras and extras <= set(_pyproject()["project"]["optional-dependencies"])
    assert ["test", "-f", f"{gpu_cfg.model.path}/config.json"] in argvs
    assert config["file_mounts"].get(f"/home/{config['auth']['ssh_user']}/.ray/auth_token")

    starts = {}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        found = [
            (env, argv)
            for line in config[key]
            for env, argv in _simple_commands(line)
            if argv[:2] == ["ray", "start"]
        ]
        assert len(found) == 1, found
        env, starts[key] = found[0]
        assert env.get("RAY_AUTH_MODE") == "token"
    assert "--head" in starts["head_start_ray_commands"]
    assert "--dashboard-host=127.0.0.1" in starts["head_start_ray_commands"]
    assert "--address=$RAY_HEAD_IP:6379" in starts["worker_start_ray_commands"]
    every_command = " ".join(
        str(c) for key, value in config.items() if key.endswith("commands") for c in value
    )
    assert "0.0.0.0" not in every_command


# --- KubeRay RayJob -----------------------------------------------------------------------------


def test_rayjob_manifest_runs_ray_of_the_pinned_version(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images and all(ray.__version__ in image for image in images), images
    base = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), flags=re.M)
    assert base == [f"rayproject/ray:{ray.__version__}-py311-gpu"]


def test_rayjob_entrypoint_is_a_treegrpo_command_with_a_valid_config(rayjob):
    argv, cfg = _entrypoint_config(rayjob["spec"]["entrypoint"])
    assert argv[0] == "treegrpo"
    assert cfg.cluster.address, "a job must join the cluster, not start a local Ray"
    assert cfg.engine.kind == "vllm"


@pytest.mark.parametrize(
    "extra, error",
    [
        ("--set cluster.rollout_resource.rollout_node=1", UserInputError),  # a misspelt field
        ("--set 'tree.k= 2'", AssertionError),  # loses its quotes in the job's shell
        ("--set cluster.rollout_workers=3", UserInputError),  # 32 prompts per step / 3 workers
    ],
)
def test_entrypoint_check_rejects_broken_entrypoints(rayjob, extra, error):
    with pytest.raises(error):
        _entrypoint_config(f"{rayjob['spec']['entrypoint']} {extra}")


def test_rayjob_worker_groups_serve_the_pools(rayjob):
    _, cfg = _entrypoint_config(rayjob["spec"]["entrypoint"])
    cluster = rayjob["spec"]["rayClusterSpec"]
    nodes = {}
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        # KubeRay hands the value to `ray start --resources=...` through a shell
        words = shlex.split(group["rayStartParams"].get("resources", '"{}"'))
        assert len(words) == 1, words
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        nodes[group["groupName"]] = {**json.loads(words[0]), "GPU": gpus}
        _check_mounts(container, cfg)
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "resources" not in cluster["headGroupSpec"]["rayStartParams"]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    _check_mounts(head, cfg)

    pools = _pools(cfg)
    advertised = set().union(*(_custom(r) for r in nodes.values()))
    assert advertised == set().union(*(p.resources for p in pools))
    replicas = {g["groupName"]: g["replicas"] for g in cluster["workerGroupSpecs"]}
    for pool in pools:
        host = _pool_hosts(pool, nodes)
        capacity = replicas[host] * pool.per_node(nodes[host])
        assert capacity >= pool.workers, f"group {host} has room for {capacity} {pool.name} workers"


def _check_mounts(container: dict[str, Any], cfg: JobConfig) -> None:
    """Every pod sees the model directory and the (shared) run directory."""
    mounts = [PurePosixPath(m["mountPath"]) for m in container.get("volumeMounts", [])]
    for path in (cfg.model.path, cfg.train.output_dir):
        assert any(PurePosixPath(path).is_relative_to(m) for m in mounts), (container["name"], path)


def test_entrypoint_program_is_the_packages_console_script(rayjob):
    program = shlex.split(rayjob["spec"]["entrypoint"])[0]
    target = _pyproject()["project"]["scripts"][program]
    module, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module), function))
