"""Bad input at the command line: one line naming the problem and the fix, exit code 2."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
from huggingface_hub import constants

from treegrpo_ray.commands.cli import main


@pytest.fixture
def treegrpo(capsys):
    """Run the CLI in-process; returns (exit code, stderr)."""

    def run(*args):
        capsys.readouterr()  # drop what the test itself printed while setting up
        code = main(list(args))
        return subprocess.CompletedProcess(args, code, "", capsys.readouterr().err)

    return run


def _fresh_output(tmp_path):
    """Overrides that keep a test's run directory away from the working directory's runs/."""
    return ("--set", f"train.output_dir={tmp_path / 'runs'}")


def _assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_unknown_preset_in_a_real_process():
    result = subprocess.run(
        [sys.executable, "-m", "treegrpo_ray.commands.cli", "train", "no-such-preset"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_one_line_error(result, "unknown preset 'no-such-preset'", "tiny-multihop")


def test_malformed_yaml(treegrpo, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tree: {m: 2\n")
    _assert_one_line_error(treegrpo("train", str(path)), "malformed YAML", str(path))


def test_unknown_field(treegrpo):
    result = treegrpo("train", "tiny-multihop", "--set", "tree.mm=4")
    _assert_one_line_error(result, "unknown field 'tree.mm'")


def test_invalid_value_names_field_and_value(treegrpo):
    result = treegrpo("train", "tiny-multihop", "--set", "tree.m=-1")
    _assert_one_line_error(result, "tree.m", "greater than 0", "-1")


def test_missing_model_directory(treegrpo, tmp_path):
    missing = tmp_path / "nowhere"
    result = treegrpo(
        "train", "tiny-multihop", "--set", f"model.path={missing}", *_fresh_output(tmp_path)
    )
    _assert_one_line_error(result, str(missing), "does not exist")


def test_a_hub_id_missing_offline_makes_no_network_attempt(tmp_path):
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE as a user sets them, in a real process: one line naming
    the node's cache and both fixes; the Hub endpoint (a socket listening here) sees no
    connection."""
    with socket.create_server(("127.0.0.1", 0)) as hub:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(tmp_path / "hf"),
            "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}",
        }
        result = subprocess.run(
            [sys.executable, "-m", "treegrpo_ray.commands.cli", "train", "tiny-multihop",
             "--set", "model.path=Nobody/missing-model", *_fresh_output(tmp_path)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        hub.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection waits to be accepted
            hub.accept()
    _assert_one_line_error(
        result,
        "model.path: Nobody/missing-model has no complete snapshot in the Hugging Face cache",
        f"({tmp_path / 'hf'}) and HF_HUB_OFFLINE is set",
        "hf download Nobody/missing-model",
        "point model.path at a local model directory",
    )


def test_a_hub_id_the_hub_cannot_serve(treegrpo, tmp_path, monkeypatch):
    # Online, with the Hub's endpoint at a closed local port (what HF_ENDPOINT sets at import):
    # the download is refused at once.
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    result = treegrpo(
        "train", "tiny-multihop", "--set", "model.path=Nobody/missing-model",
        *_fresh_output(tmp_path),
    )  # fmt: skip
    _assert_one_line_error(
        result,
        f"({tmp_path / 'hf'}) and could not be downloaded (ConnectError: ",
        "hf download Nobody/missing-model",
        "point model.path at a local model directory",
    )


@pytest.mark.parametrize(
    "bad", ["train.steps=0", "sampling.top_p=1.5", "ppo.advantage=grpo", "tree.select=greedy"]
)
def test_other_invalid_values(treegrpo, bad):
    result = treegrpo("train", "tiny-multihop", "--set", bad)
    _assert_one_line_error(result, bad.split("=")[0])


def test_a_block_size_the_cpu_build_of_vllm_refuses(treegrpo):
    result = treegrpo(
        "train", "tiny-multihop", "--set", "engine.kind=vllm", "--set", "engine.vllm.device=cpu",
        "--set", "engine.vllm.block_size=16",
    )  # fmt: skip
    _assert_one_line_error(result, "engine.vllm.block_size 16", "multiple of 32")


def test_an_allocation_floor_above_n(treegrpo):
    result = treegrpo(
        "train", "tiny-multihop", "--set", "tree.allocate=adaptive", "--set", "tree.allocate_floor=3",
    )  # fmt: skip
    _assert_one_line_error(result, "tree.allocate_floor 3 exceeds tree.n 2")


def test_an_entropy_rule_on_vllm_without_entropies(treegrpo):
    result = treegrpo(
        "train", "tiny-multihop", "--set", "engine.kind=vllm", "--set", "engine.vllm.device=cpu",
        "--set", "engine.vllm.entropy_topk=0", "--set", "tree.select=entropy",
    )  # fmt: skip
    _assert_one_line_error(result, "tree.select entropy reads token entropies", "entropy_topk")


def test_vllm_engine_without_vllm_installed(treegrpo, tmp_path, monkeypatch):
    # This process may have vLLM: stand in for a machine without it.
    monkeypatch.setattr("treegrpo_ray.cluster.train.installed_vllm_build", lambda: None)
    result = treegrpo(
        "train", "tiny-multihop", "--set", "engine.kind=vllm", *_fresh_output(tmp_path)
    )
    _assert_one_line_error(result, "vLLM is not installed", "scripts/install-vllm-cpu.sh")
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_tokenizer_that_does_not_match_the_model(treegrpo, tmp_path):
    from treegrpo_ray.config import TinyModelConfig
    from treegrpo_ray.modeling import build_tiny_model, build_word_tokenizer

    build_word_tokenizer([f"w{i}" for i in range(20)], tmp_path)  # 23 tokens
    build_tiny_model(TinyModelConfig(num_layers=1), vocab_size=8, seed=0).save_pretrained(tmp_path)
    result = treegrpo(
        "train", "tiny-multihop", "--set", f"model.path={tmp_path}", *_fresh_output(tmp_path)
    )
    _assert_one_line_error(result, "model.path", "tokenizer does not match", "23 tokens")


def test_model_directory_without_tokenizer(treegrpo, tmp_path):
    from treegrpo_ray.modeling import TinyModelConfig, build_tiny_model

    build_tiny_model(TinyModelConfig(num_layers=1), vocab_size=8, seed=0).save_pretrained(tmp_path)
    result = treegrpo(
        "train", "tiny-multihop", "--set", f"model.path={tmp_path}", *_fresh_output(tmp_path)
    )
    _assert_one_line_error(result, "model.path", "no tokenizer.json")


def test_existing_run_directory_is_not_mixed_into(treegrpo, tmp_path):
    (tmp_path / "old" / "metrics.jsonl").parent.mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("{}\n")
    result = treegrpo(
        "train", "tiny-multihop", "--set", "name=old", "--set", f"train.output_dir={tmp_path}"
    )
    _assert_one_line_error(result, str(tmp_path / "old"), "already exists", "--overwrite")


@pytest.fixture
def stopped_run(tmp_path):
    """A run directory as `treegrpo train` leaves it: its config, and a checkpoint at step 2 (its
    counters only, with the manifest that makes it pass verification)."""
    from treegrpo_ray.config import load_config, save_run_config
    from treegrpo_ray.learners.checkpoint import write_manifest

    cfg = load_config("tiny-multihop", ["name=stopped", f"train.output_dir={tmp_path}"])
    save_run_config(cfg.with_absolute_paths())
    step = cfg.run_dir / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"policy_version": 2}')
    write_manifest(step, 2)
    (cfg.run_dir / "checkpoints" / "latest").write_text("step-000002\n")
    return cfg.run_dir


def test_resume_without_a_saved_config(treegrpo, tmp_path):
    result = treegrpo("train", "--resume", str(tmp_path))
    _assert_one_line_error(result, f"cannot resume {tmp_path}", "no config.yaml")


def test_resume_without_a_checkpoint(treegrpo, stopped_run):
    shutil.rmtree(stopped_run / "checkpoints")
    result = treegrpo("train", "--resume", str(stopped_run))
    _assert_one_line_error(result, "holds no checkpoint yet", "--overwrite")


def test_resume_of_a_run_that_reached_its_steps(treegrpo, stopped_run):
    result = treegrpo("train", "--resume", str(stopped_run), "--set", "train.steps=2")
    _assert_one_line_error(result, "checkpoint is at step 2", "--set train.steps=N (N > 2)")


def test_resume_refuses_a_change_of_what_is_learned(treegrpo, stopped_run):
    result = treegrpo(
        "train",
        "tiny-multihop",
        "--resume",
        str(stopped_run),
        "--set",
        "ppo.kl_coef=0.1",
        "--set",
        "tree.m=3",
        "--set",
        "train.steps=200",
    )
    _assert_one_line_error(result, "with a different tree.m, ppo.kl_coef than it was started")


def test_train_needs_a_config_or_resume(treegrpo):
    _assert_one_line_error(treegrpo("train"), "CONFIG", "--resume")


@pytest.fixture
def saved_run(tmp_path):
    """A run directory with the trees of step 4 saved: one tree, a search node and two leaves."""
    import torch

    from treegrpo_ray.packing import pack_trees
    from treegrpo_ray.saved_trees import node_advantages, saved_trees_table, write_saved_trees
    from treegrpo_ray.tree import ROOT, Tree

    tree = Tree(tree_id=0, group_id=0, prompt_ids=[1, 2])
    common = dict(action_ids=[3], action_logprobs=[-0.5], policy_version=3)
    tree.add(ROOT, obs_ids=[4], finished=False, finish_reason="stop", role="search",
             tool_call=True, **common)  # fmt: skip
    for reward in (1.0, 0.0):
        tree.add(0, obs_ids=[], finished=True, finish_reason="done", role="answer",
                 tool_call=False, reward=reward, **common)  # fmt: skip
    advantages = torch.tensor([0.7, -0.7])
    routed = pack_trees([tree], 64, 0).route_nodes(advantages, "paper")
    table = saved_trees_table(
        [tree], node_advantages([tree], advantages, routed), str, {"step": 4, "metrics": {}}
    )
    write_saved_trees(tmp_path, 4, table)
    return tmp_path


def test_trees_of_a_missing_run(treegrpo, tmp_path):
    result = treegrpo("trees", str(tmp_path / "nowhere"))
    _assert_one_line_error(result, f"no run directory {tmp_path / 'nowhere'}")


def test_trees_of_a_run_that_saved_none(treegrpo, tmp_path):
    result = treegrpo("trees", str(tmp_path), "--text")
    _assert_one_line_error(result, "holds no saved trees", "train.save_trees_every")


def test_trees_of_a_step_that_was_not_saved(treegrpo, saved_run):
    result = treegrpo("trees", str(saved_run), "--step", "5")
    _assert_one_line_error(result, "step 5", "was not saved", "saved steps: 4")


def test_trees_of_a_prompt_the_step_does_not_have(treegrpo, saved_run):
    result = treegrpo("trees", str(saved_run), "--prompt", "1", "--text")
    _assert_one_line_error(result, "--prompt 1 is out of range", "1 prompts (0-0)")


@pytest.mark.parametrize("view", [(), ("--text", "--step", "6")], ids=["page", "text"])
def test_trees_from_a_corrupt_file(treegrpo, saved_run, view):
    corrupt = saved_run / "trees" / "step-000006.parquet"
    corrupt.write_bytes(b"PAR1 half a file")
    result = treegrpo("trees", str(saved_run), *view)
    _assert_one_line_error(result, str(corrupt), "not a readable saved-trees file")
    assert not (saved_run / "trees.html").exists()
