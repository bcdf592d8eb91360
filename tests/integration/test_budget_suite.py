"""The budget suite's machinery on 2-update runs: jobs, cost accounting, matching, aggregation
over seeds, table and plot, and a rerun that skips finished runs."""

import argparse
import json
from dataclasses import replace

import pytest
import yaml

from treegrpo_ray.budget_stats import interpolate
from treegrpo_ray.experiments.budget_suite import QUICK, add_arguments, jobs, run_suite

pytestmark = pytest.mark.slow  # in-process runs of the warm-started policy

ARMS = ("chain-2", "chain-3", "tree-1x2x1")


@pytest.fixture(scope="module")
def suite(tiny_cfg, tiny_policy, tmp_path_factory):
    """(settings, output dir, result, log lines) of a small suite: 3 arms x 2 starts x 2 seeds."""
    root = tmp_path_factory.mktemp("budget")
    preset = root / "preset.yaml"
    warm = {"steps": tiny_cfg.warmstart.steps, "cache_dir": tiny_cfg.warmstart.cache_dir}
    preset.write_text(yaml.safe_dump({"extends": "tiny-multihop", "warmstart": warm}))
    settings = replace(
        QUICK,
        steps=2,
        prompts_per_step=2,
        seeds=2,
        headline_seeds=2,
        eval_questions=8,
        eval_samples=2,
        arms=ARMS,
        # the same warm start under both names: the machinery is under test, not the start
        starts={"standard": (), "low": ()},
    )
    log: list[str] = []
    result = run_suite(str(preset), settings, root / "out", workers=2, log=log.append)
    return settings, root / "out", result, log, str(preset)


def _record(out, start, arm, seed):
    return json.loads((out / "runs" / start / arm / f"seed{seed}.json").read_text())


def test_every_run_records_its_measured_cost_along_the_run(suite):
    settings, out, _, log, preset = suite
    assert len(jobs(preset, settings)) == 3 * 2 * 2
    leaves = {"chain-2": 2, "chain-3": 3, "tree-1x2x1": 3}  # M * (1 + L * N) per prompt
    for job in jobs(preset, settings):
        points = _record(out, job.start, job.arm, job.seed)["points"]
        assert [p["step"] for p in points] == [0, 1, 2]  # warm start, 50%, 100% of 2 updates
        assert [p["prompts"] for p in points] == [0, 2, 4]
        final = points[-1]
        assert final["leaves"] == leaves[job.arm] * 4
        assert 0 < points[1]["generated_tokens"] < final["generated_tokens"]
        assert 0 < points[1]["train_seconds"] < final["train_seconds"]
        record = _record(out, job.start, job.arm, job.seed)
        assert 0 <= record["groups_with_variance"] <= 1 and 0 <= record["train_reward"] <= 1
    assert sum(line.startswith("[") for line in log) == 12


def test_comparisons_are_paired_by_seed_and_matched_on_cost(suite):
    _, out, result, _, _ = suite
    pair = result["starts"]["low"]["pairs"]["tree-1x2x1 vs chain-2"]
    assert pair["seeds"] == [0, 1]
    tree = [_record(out, "low", "tree-1x2x1", s) for s in (0, 1)]
    chain = [_record(out, "low", "chain-2", s) for s in (0, 1)]
    # equal updates: the final evaluations
    expected = [
        t["points"][-1]["greedy_em"] - c["points"][-1]["greedy_em"]
        for t, c in zip(tree, chain, strict=True)
    ]
    assert pair["updates"]["greedy_em"]["differences"] == pytest.approx(expected)
    # equal generated tokens: both read at the smaller final total
    diffs = []
    for t, c in zip(tree, chain, strict=True):
        curves = [
            ([p["generated_tokens"] for p in r["points"]], [p["sampled_em"] for p in r["points"]])
            for r in (t, c)
        ]
        at = min(curves[0][0][-1], curves[1][0][-1])
        diffs.append(interpolate(*curves[0], at) - interpolate(*curves[1], at))
    assert pair["tokens"]["sampled_em"]["differences"] == pytest.approx(diffs)
    assert pair["tokens"]["sampled_em"]["mean"] == pytest.approx(sum(diffs) / 2)
    ratios = sorted(
        t["seconds_per_update"] / c["seconds_per_update"] for t, c in zip(tree, chain, strict=True)
    )
    assert pair["wall_ratio"] == pytest.approx(sum(ratios) / 2)  # the median of two

    headline = result["headline"]
    assert (headline["start"], headline["tree"], headline["chain"]) == (
        "low",
        "tree-1x2x1",
        "chain-2",
    )
    assert headline["mean"] == pair["tokens"]["greedy_em"]["mean"]
    assert headline["n"] == 2


def test_report_files(suite):
    _, out, result, _, _ = suite
    saved = json.loads((out / "results.json").read_text())
    assert saved["headline"]["mean"] == pytest.approx(result["headline"]["mean"])
    arm = saved["starts"]["standard"]["arms"]["tree-1x2x1"]
    assert arm["leaves_per_prompt"] == 3.0 and arm["seeds"] == [0, 1]
    runs = [_record(out, "standard", "tree-1x2x1", s) for s in (0, 1)]
    assert arm["groups_with_variance"]["mean"] == pytest.approx(
        sum(r["groups_with_variance"] for r in runs) / 2
    )
    table = (out / "results.md").read_text()
    assert "**Headline (pre-registered)**: tree-1x2x1 − chain-2" in table
    for name in ARMS:
        assert f"| {name} |" in table
    assert (out / "budget_efficiency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_skips_finished_runs(suite):
    settings, out, result, _, preset = suite
    log: list[str] = []
    again = run_suite(preset, settings, out, workers=1, log=log.append)
    assert "12 runs, 0 to do, 1 at a time" in log
    assert again["headline"]["mean"] == result["headline"]["mean"]


def test_arm_and_start_subsets_from_the_command_line():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--arms", "chain-2,tree-1x2x1", "--starts", "low"])
    assert args.arms == ("chain-2", "tree-1x2x1") and args.starts == ("low",)
    with pytest.raises(SystemExit):
        parser.parse_args(["--arms", "chain-5"])
