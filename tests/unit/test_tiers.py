"""The test tiers and their guard, on an inner pytest session that loads this suite's conftest.

Starting Ray is played by a test double: the inner test writes a session directory where Ray
writes its sessions (``$RAY_TMPDIR/ray/session_*``), which is what the guard watches."""

from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = """
import os
from pathlib import Path

import pytest


def start_ray_double():
    Path(os.environ["RAY_TMPDIR"], "ray", "session_2026-12-05_00-00-00_000000_1").mkdir(parents=True)


def test_plain():
    pass


def test_starts_ray_unmarked():
    start_ray_double()


@pytest.mark.ray
def test_starts_ray_marked():
    start_ray_double()


def test_warm_policy_unmarked(tiny_policy):
    pass


@pytest.mark.vllm
def test_vllm_unmarked():
    pass


@pytest.mark.slow
def test_slow():
    pass
"""


@pytest.fixture
def inner(pytester, tmp_path, monkeypatch):
    """Runs the inner session with ``args``; returns its outcomes by test name."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=TESTS)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))

    def run(*args: str) -> dict[str, str]:
        reports = pytester.inline_run(*args, "-p", "no:cacheprovider").getreports()
        outcome: dict[str, str] = {}
        for report in reports:
            if "::" not in getattr(report, "nodeid", ""):
                continue  # a collection report
            name = report.nodeid.split("::")[-1]
            if report.failed or name not in outcome:
                outcome[name] = "failed" if report.failed else report.outcome
        return outcome

    return run


def test_the_default_tier_is_fast_and_the_guard_fails_what_needs_a_marker(inner):
    outcome = inner()
    assert outcome == {
        "test_plain": "passed",
        "test_starts_ray_unmarked": "failed",
        "test_warm_policy_unmarked": "failed",
        "test_vllm_unmarked": "failed",
    }


def test_tiers_pick_their_tests(inner):
    assert inner("--tier", "ray") == {"test_starts_ray_marked": "passed"}
    assert inner("--tier", "slow") == {"test_slow": "passed"}
    assert len(inner("--tier", "all")) == 6


def test_an_unknown_tier_is_a_usage_error(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner="def test_plain():\n    pass\n")
    result = pytester.runpytest_inprocess("--tier", "fastest")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--tier fastest: the tiers are fast, ray, slow or all*"])
