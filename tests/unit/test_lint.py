"""Lint in the test command (and so in CI): ruff over the checkout, mypy over all package code
(the core, the actors, the learners and the cluster wiring)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
# the core and every folder pyproject installs beside it (actors/, learners/, cluster/, ...)
PACKAGE_FOLDERS = [
    "treegrpo_ray",
    *tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values(),
]


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        # a minute or two without its cache (a fresh clone): the slow tier
        pytest.param(
            ["mypy", *PACKAGE_FOLDERS],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_checkout_is_lint_clean(command):
    if shutil.which(command[0]) is None:
        pytest.skip(f"{command[0]} is not installed (the dev extra)")
    done = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
