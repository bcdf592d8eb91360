"""``treegrpo bench profile --probe`` at toy size on the warm-started tiny policy: the probe's
trees, their profile, and a rerun that reads the saved probe instead of probing again."""

import json

import pyarrow.parquet as pq
import pytest

from treegrpo_ray.commands.cli import main
from treegrpo_ray.tree import trees_from_arrow


@pytest.mark.slow  # a rollout probe of the warm-started policy
def test_probe_profiles_the_policy_and_a_rerun_reads_it_back(tiny_policy, tmp_path, capsys):
    args = ["bench", "profile", "--probe", "--preset", "tiny-multihop"]
    args += ["--set", f"model.path={tiny_policy}", "--shape", "3x2x1", "--prompts", "8"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    first = json.loads((tmp_path / "profile.json").read_text())
    trees = trees_from_arrow(pq.read_table(tmp_path / "probe.parquet"))
    assert len(trees) == 8 * 3 and first["prompts"] == 8
    assert first["leaves"] == 8 * 3 * 3 == sum(len(t.leaves()) for t in trees)
    # every pair of leaves of a prompt, once: 9 leaves -> 36 pairs
    assert sum(d["pairs"] for d in first["depths"]) == 8 * 36
    assert [p["arm"] for p in first["predictions"]] == [
        "chain-2", "chain-3", "chain-4", "tree-1x2x1", "tree-2x2x1"
    ]  # fmt: skip
    for row in first["predictions"]:
        assert 0.0 <= row["share"] <= 1.0
    assert (tmp_path / "profile.png").stat().st_size > 0
    capsys.readouterr()

    assert main([*args, "--out", str(tmp_path)]) == 0
    assert "reading" in capsys.readouterr().out
    assert json.loads((tmp_path / "profile.json").read_text()) == first


def test_an_arm_it_cannot_model_is_a_one_line_error(tmp_path, capsys):
    args = ["bench", "profile", "--probe", "--arms", "tree-1x2x2", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "give chain-G or tree-MxNx1" in capsys.readouterr().err
