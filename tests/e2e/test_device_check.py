"""The device check on a machine without CUDA: the CUDA parts skipped with the reason, the rest
measured (on a GPU machine it runs whole: scripts/device-check.sh, README)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # runs the GPU tests and a learner in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check runs whole (minutes)")
def test_the_device_check_runs_without_cuda_and_says_what_it_skipped(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "scripts/device-check.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "device check: passed" in done.stdout
    report = json.loads((tmp_path / "device_check.json").read_text())
    # flex's forward on CPU gives the dense mask's log-probs
    for row in report["flex_vs_dense"].values():
        assert row["tokens"] > 0 and row["logprob_max_abs_diff"] <= 1e-5
    packed = report["packed_vs_paths"]
    assert packed["packed_forwarded"] < packed["path_forwarded"]
    for section in ("flex_vs_dense_cuda", "plan_vs_peak", "plan_vs_peak_1b"):
        assert "no CUDA device" in report[section]["skipped"]
    assert "skipped" in (tmp_path / "gpu-tests.log").read_text()
