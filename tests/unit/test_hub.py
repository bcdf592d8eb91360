"""``model.path`` as a Hugging Face Hub id, resolved in this process's (offline) cache."""

from __future__ import annotations

import socket

import pytest
import torch
from huggingface_hub import constants

from treegrpo_ray.errors import UserInputError
from treegrpo_ray.hub import is_hub_id, resolve_policy_path
from treegrpo_ray.learners.policies import resolve_model_path
from treegrpo_ray.modeling import check_policy_dir, load_policy, load_tokenizer


@pytest.fixture
def offline_hub(hub_policy, monkeypatch):
    """This process looks Hub ids up in ``hub_policy.cache`` only: what HF_HUB_CACHE=<cache>
    HF_HUB_OFFLINE=1 give a process (huggingface_hub reads both into these when imported)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_policy.cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_policy


def test_a_hub_id_resolves_to_the_snapshot_refs_main_names(offline_hub):
    snapshot = resolve_policy_path(offline_hub.repo_id)
    assert snapshot == offline_hub.snapshot
    # models--treegrpo-test--tiny-multihop/snapshots/<the commit in refs/main>
    refs_main = offline_hub.cache / "models--treegrpo-test--tiny-multihop" / "refs" / "main"
    assert snapshot.name == refs_main.read_text()
    assert snapshot.parent.parent == refs_main.parent.parent
    assert resolve_policy_path(snapshot) == snapshot  # a directory is itself


def test_the_loaders_take_the_hub_id(offline_hub):
    check_policy_dir(offline_hub.repo_id)
    by_id, by_id_tokenizer = load_policy(offline_hub.repo_id)
    by_dir, by_dir_tokenizer = load_policy(offline_hub.snapshot)
    assert load_tokenizer(offline_hub.repo_id).get_vocab() == by_dir_tokenizer.get_vocab()
    assert by_id_tokenizer.get_vocab() == by_dir_tokenizer.get_vocab()
    weights, expected = by_id.state_dict(), by_dir.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_the_driver_passes_a_hub_id_on_as_written_and_a_directory_absolute(
    offline_hub, make_cfg, tmp_path, monkeypatch
):
    # Each worker resolves the id in its own node's cache, so the driver must not send its own
    # snapshot path; a relative directory becomes absolute (workers run elsewhere).
    assert resolve_model_path(make_cfg(f"model.path={offline_hub.repo_id}")) == offline_hub.repo_id
    monkeypatch.chdir(offline_hub.snapshot.parent)
    relative = make_cfg(f"model.path={offline_hub.snapshot.name}")
    assert resolve_model_path(relative) == str(offline_hub.snapshot)


@pytest.mark.parametrize(
    "text, hub_id",
    [
        ("Qwen/Qwen2.5-3B-Instruct", True),
        ("meta-llama/Llama-3.2-3B", True),
        ("/models/Qwen2.5-3B", False),  # absolute path
        ("./Qwen/Qwen2.5-3B", False),  # relative path
        ("~/Qwen/Qwen2.5-3B", False),  # home path
        ("models/Qwen/Qwen2.5-3B", False),  # two slashes: a path
        ("Qwen2.5-3B", False),  # no organisation: a relative path
        ("Qwen/Qwen 2.5", False),  # a space: not a Hub id
        ("runs/Qwen2.5-3B", False),  # runs/ exists below: a mistyped path
    ],
)
def test_what_reads_as_a_hub_id(text, hub_id, tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert is_hub_id(text) is hub_id


def test_a_mistyped_local_path_is_reported_as_a_directory(offline_hub, tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError) as err:
        resolve_policy_path("runs/tiny-multihop")
    assert str(err.value) == (
        "model.path: policy directory runs/tiny-multihop does not exist; point model.path at a "
        "directory written by save_pretrained or a Hugging Face Hub id (Org/Name), or set "
        "model.path=null to warm-start the tiny model"
    )


def test_an_uncached_id_offline_names_the_node_cache_and_both_fixes(offline_hub):
    with pytest.raises(UserInputError) as err:
        load_policy("treegrpo-test/not-downloaded")
    assert str(err.value) == (
        "model.path: treegrpo-test/not-downloaded has no complete snapshot in the Hugging Face "
        f"cache of node {socket.gethostname()} ({offline_hub.cache}) and HF_HUB_OFFLINE is set; "
        "download it into the cache on every node (hf download treegrpo-test/not-downloaded) or "
        "point model.path at a local model directory"
    )
