"""``treegrpo bench peer`` at toy size: TRL's GRPOTrainer and ours on the warm-started tiny
policy, so that the harness cannot rot (the measured comparison runs on SmolLM2: README)."""

import json

import pytest

pytest.importorskip("trl", reason="the peer extra (pip install -e '.[peer]') is not installed")

from treegrpo_ray.commands.cli import main  # noqa: E402


@pytest.mark.slow  # TRL and ours on the warm-started policy
def test_both_trainers_generate_and_take_the_same_step(tiny_policy, tmp_path, capsys):
    args = ["bench", "peer", "--preset", "tiny-multihop-lora", "--set", f"model.path={tiny_policy}"]
    args += ["--prompts", "2", "--group", "3", "--max-new-tokens", "8", "--repeats", "2"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    for prompts in ("short", "long"):
        for trainer in ("trl", "ours"):
            runs = report["generation"][prompts][trainer]
            assert len(runs) == 2 and all(r["tokens"] > 0 for r in runs)
    long = report["generation"]["long"]
    # the siblings' shared prompt is computed once by our engine, six times in TRL's padded batch
    assert long["ours"][0]["prefill_tokens"] < long["trl"][0]["prefill_tokens"]
    trl, ours = report["learner"]["trl"], report["learner"]["ours"]
    assert trl[0]["path_tokens"] == ours[0]["path_tokens"]
    # the same sequences, advantages, coefficients and starting adapter: the same step
    for key in ("loss", "grad_norm"):
        assert ours[0][key] == pytest.approx(trl[0][key], rel=0.05), key
    assert ours[0]["grad_norm"] > 0
    assert "| whole update (long prompts), seconds |" in capsys.readouterr().out
    assert (tmp_path / "table.md").read_text().startswith("| measurement | TRL | ours |")
