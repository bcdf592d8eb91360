"""The package as users get it: a non-editable install of the image's file set, used elsewhere.

The files that ``cluster/deploy/Dockerfile`` copies into the image are copied to a temporary
directory and installed from there, without ``-e``, into a new virtual environment that sees the
packages of the environment running the tests (a venv's, or the base interpreter's), so that
nothing is downloaded: only this package is built. From a directory
outside both, the installed ``treegrpo`` shows its help, trains 2 updates of the tiny preset on a
local Ray instance, and runs the RayJob manifest's entrypoint up to the point where it needs the
GPU model directory that the image mounts.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import tomllib
import yaml

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "cluster" / "deploy"
IMAGE_WORKDIR = "/home/ray/treegrpo-ray"  # the Dockerfile's WORKDIR
# the checkout's top-level folders that must not install under their own (generic) names
GENERIC_NAMES = (
    *tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values(),
    "benchmarks",
)


def _image_file_set(dest: Path) -> Path:
    """Copy what the Dockerfile's COPY lines put into the image's working directory."""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        words = shlex.split(line)
        if not words or words[0] != "COPY":
            continue
        *sources, target = [w for w in words[1:] if not w.startswith("--")]
        for source in sources:
            src = REPO / source
            out = dest / target / src.name if target.endswith("/") else dest / target
            if src.is_dir():
                shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)
    return dest


def _site_dirs_of_this_environment() -> list[str]:
    """The site-packages directories the running interpreter imports from: a venv's own (and the
    base's, when the venv includes them), or the base interpreter's."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return dirs


def _new_venv_seeing_this_environment(env_dir: Path) -> Path:
    """A new venv whose interpreter also imports this environment's packages; returns its python.

    ``system_site_packages=True`` would show the *base* interpreter's packages, not those of the
    venv the tests may run in (venvs do not nest). A ``.pth`` line that calls ``site.addsitedir``
    adds each directory with its own ``.pth`` files, after the new venv's site-packages, so the
    copy installed there is the one imported."""
    venv.create(env_dir, system_site_packages=False, with_pip=False)
    python = env_dir / "bin" / "python"
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([python, "-c", ask], capture_output=True, text=True, check=True)
    lines = [f"import site; site.addsitedir({d!r})" for d in _site_dirs_of_this_environment()]
    Path(purelib.stdout.strip(), "_test_env_packages.pth").write_text("\n".join(lines) + "\n")
    return python


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ directory of a new venv with the image's file set installed (not editable)."""
    root = tmp_path_factory.mktemp("install")
    source = _image_file_set(root / "image")
    env_dir = root / "venv"
    python = _new_venv_seeing_this_environment(env_dir)
    pip = [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run([*pip, str(source)], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr
    return env_dir / "bin"


def _run(bin_dir: Path, cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a program of the venv; no PYTHONPATH, so only the installed copy can be imported."""
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        timeout=timeout,
    )


def test_the_wheel_installs_only_namespaced_packages(installed, tmp_path):
    code = (
        "import importlib.util, json, treegrpo_ray.commands.cli as cli; "
        f"print(json.dumps([cli.__file__] + [bool(importlib.util.find_spec(n)) for n in {GENERIC_NAMES!r}]))"
    )
    done = _run(installed, tmp_path, "python", "-c", code)
    assert done.returncode == 0, done.stderr
    cli_file, *generic_found = json.loads(done.stdout)
    assert Path(cli_file).is_relative_to(installed.parent)  # the installed copy, not the checkout
    assert generic_found == [False] * len(GENERIC_NAMES)


def test_the_installed_command_trains_two_updates(installed, tmp_path, tiny_cfg, tiny_policy):
    assert _run(installed, tmp_path, "treegrpo", "--help").returncode == 0
    overrides = [
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.eval_every=0",
        "train.final_eval_questions=8",
        f"train.output_dir={tmp_path / 'runs'}",
        f"warmstart.steps={tiny_cfg.warmstart.steps}",
        f"warmstart.cache_dir={tiny_cfg.warmstart.cache_dir}",  # tiny_policy is cached there
    ]
    sets = [arg for override in overrides for arg in ("--set", override)]
    done = _run(installed, tmp_path, "treegrpo", "train", "tiny-multihop", "--quiet", *sets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("treegrpo: tiny-multihop done in")
    run = tmp_path / "runs" / "tiny-multihop"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollout/worker_versions"] == [2]
    # the inspector's page template is installed with the package
    done = _run(installed, tmp_path, "treegrpo", "trees", str(run))
    assert done.returncode == 0, done.stderr
    assert 'data-step="2"' in (run / "trees.html").read_text()


def test_the_rayjob_entrypoint_runs_from_the_image_file_set(installed, tmp_path):
    """The manifest's command, with the image's working directory at the copied file set, gets
    through the installed CLI and its config to the model directory the image mounts."""
    entrypoint = yaml.safe_load((DEPLOY / "rayjob.yaml").read_text())["spec"]["entrypoint"]
    image = installed.parent.parent / "image"
    words = shlex.split(entrypoint.replace(IMAGE_WORKDIR, str(image)))
    done = _run(installed, tmp_path, *words, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == (
        "treegrpo: error: model.path: policy directory /models/Qwen2.5-3B-Instruct does not "
        "exist; point model.path at a directory written by save_pretrained or a Hugging Face Hub "
        "id (Org/Name), or set model.path=null to warm-start the tiny model"
    )


def test_the_checkout_runs_without_an_install(tmp_path):
    """A Ray Jobs working directory or ``PYTHONPATH=.`` gives the same package names, with no
    install in sight (``-S``: not even the editable one in site-packages)."""
    code = "import treegrpo_ray.actors.engines as e, treegrpo_ray.cluster as c; print(e.__file__)"
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == REPO / "actors" / "engines" / "__init__.py"
