"""Ray's single-machine mode for a local run is set only where it can take effect: before Ray
is imported (a run's own Ray is then on loopback: tests/integration/test_pipeline.py)."""

import subprocess
import sys

from treegrpo_ray.cluster.local_ray import LOOPBACK_ENV, cluster_address


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_loopback_is_set_before_ray_is_imported_and_not_after():
    (name,) = LOOPBACK_ENV
    check = "from treegrpo_ray.cluster.local_ray import keep_local_ray_on_loopback as k; "
    before = _python(check + f"import os; print(k(), os.environ.get({name!r}))")
    assert before == "True 0"
    after = _python(f"import ray; {check}import os; print(k(), os.environ.get({name!r}))")
    assert after == "False None"


def test_a_run_joins_the_configured_cluster_or_starts_its_own(make_cfg, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(make_cfg()) is None
    assert cluster_address(make_cfg("cluster.address=auto")) == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address(make_cfg()) == "10.0.0.1:6379"
