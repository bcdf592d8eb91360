"""``treegrpo bench peer-agent`` at toy size: TRL driving our environment through
``rollout_func`` beside our chain and tree runs, on the warm-started tiny policy, so that the
harness cannot rot (the measured comparison runs on SmolLM2: README)."""

import json

import pytest

pytest.importorskip("trl", reason="the peer extra (pip install -e '.[peer]') is not installed")

from treegrpo_ray.commands.cli import main  # noqa: E402
from treegrpo_ray.experiments.peer_agent import ARMS  # noqa: E402


@pytest.mark.slow  # TRL and ours on the warm-started policy
def test_trl_and_ours_train_on_the_same_questions_through_the_environment(
    tiny_policy, tmp_path, capsys
):
    args = ["bench", "peer-agent", "--preset", "tiny-multihop-lora"]
    args += ["--set", f"model.path={tiny_policy}", "--prompts", "2", "--group", "3"]
    assert main([*args, "--updates", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["questions"]) == 2 and all(len(q) == 2 for q in report["questions"])
    for arm in ARMS:
        updates = report["updates"][arm]
        assert len(updates) == 2, arm
        for update in updates:
            assert update["generated_tokens"] > 0, arm
            assert update["tool_calls"] > 0, arm  # every arm's episodes went through the env
            assert 0 < update["rollout_seconds"] < update["seconds"], arm
            assert 0.0 <= update["reward_mean"] <= 1.0, arm
    # the warm-started policy searches and answers: TRL's episodes earn rewards as ours do
    assert sum(u["reward_mean"] for u in report["updates"]["trl-chain"]) > 0
    assert "| trl-chain |" in capsys.readouterr().out
    assert (tmp_path / "table.md").read_text().startswith("| arm | update, s |")
