"""Learner checkpoints: a restored learner continues exactly; a crash mid-write loses nothing."""

import pytest
import torch

import treegrpo_ray.learners.checkpoint as checkpoint
from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.tree import trees_from_arrow


@pytest.fixture(scope="module")
def batches(tiny_cfg, untrained_policy):
    """Two batches of trees (2 prompt groups each)."""
    worker = RolloutWorker(
        untrained_policy, tiny_cfg.task, tiny_cfg.tree, tiny_cfg.sampling, seed=0
    )
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()
    return [
        trees_from_arrow(worker.expand(Lease(i, tuple(enumerate(samples[2 * i : 2 * i + 2])), i)))
        for i in range(2)
    ]


def test_a_restored_learner_takes_exactly_the_next_step(
    tiny_cfg, untrained_policy, batches, tmp_path
):
    # shuffled minibatches over two epochs: the next step depends on the restored Python RNG
    ppo = tiny_cfg.ppo.model_copy(update={"epochs": 2, "minibatches": 2})
    running = Learner(untrained_policy, ppo, temperature=1.0, seed=3)
    running.update(batches[0])
    path = checkpoint.save_checkpoint(running.state_dict(), tmp_path, extra={"next_group": 2})
    expected = running.update(batches[1])

    resumed = Learner(untrained_policy, ppo, temperature=1.0, seed=99)
    state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path))
    resumed.load_state_dict(state)
    assert path.name == "step-000001" and state.extra == {"next_group": 2}
    assert resumed.version == 1
    got = resumed.update(batches[1])
    unrepeatable = ("timing/", "learner/peak_rss_bytes")  # wall times; the process's memory
    assert {k: v for k, v in got.items() if not k.startswith(unrepeatable)} == {
        k: v for k, v in expected.items() if not k.startswith(unrepeatable)
    }
    for (name, param), other in zip(
        running.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(param, other), name


def test_a_crash_while_writing_keeps_the_previous_checkpoint(
    tiny_cfg, untrained_policy, batches, tmp_path, monkeypatch
):
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    first = checkpoint.save_checkpoint(learner.state_dict(), tmp_path)
    learner.update(batches[0])

    def crash(state, directory, extra):
        (directory / "model.safetensors").write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_state", crash)
    with pytest.raises(checkpoint.CheckpointNotWritten, match="could not be written: disk full"):
        checkpoint.save_checkpoint(learner.state_dict(), tmp_path)
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000"]
    restored = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    restored.load_state_dict(checkpoint.load_checkpoint(first))
    assert restored.version == 0


def test_only_the_newest_checkpoints_are_kept(tiny_cfg, untrained_policy, tmp_path):
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    for version in range(4):
        learner.version = version
        checkpoint.save_checkpoint(learner.state_dict(), tmp_path)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000002", "step-000003"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-000003"


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # in the tensor data, past the safetensors header
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated": (lambda d: _truncate(d / "model.safetensors"), "has"),
    "deleted": (lambda d: (d / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    "flipped": (lambda d: _flip_a_byte(d / "model.safetensors"), "does not match its checksum"),
    "manifest missing": (lambda d: (d / "manifest.json").unlink(), None),
    "latest names a missing directory": (lambda d: checkpoint.shutil.rmtree(d), "does not exist"),
}


@pytest.fixture
def two_checkpoints(tiny_cfg, untrained_policy, tmp_path):
    """``tmp_path`` with the checkpoints of versions 1 and 2 (latest: 2)."""
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    paths = []
    for version in (1, 2):
        learner.version = version
        paths.append(checkpoint.save_checkpoint(learner.state_dict(), tmp_path))
    return paths


def test_a_checkpoint_carries_a_manifest_of_its_files(two_checkpoints):
    newest = two_checkpoints[1]
    manifest = checkpoint.json.loads((newest / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["step"] == 2
    names = {p.name for p in newest.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == names
    size = (newest / "model.safetensors").stat().st_size
    assert manifest["files"]["model.safetensors"]["bytes"] == size
    want = checkpoint.xxhash.xxh3_64_hexdigest((newest / "model.safetensors").read_bytes())
    assert manifest["files"]["model.safetensors"]["xxh3_64"] == want
    check = checkpoint.check_checkpoint(newest)
    assert check.intact and check.verified


def test_a_format_1_manifest_of_crc32_checksums_is_still_verified(two_checkpoints):
    newest = two_checkpoints[1]
    files = {
        p.name: {"bytes": p.stat().st_size, "crc32": checkpoint.zlib.crc32(p.read_bytes())}
        for p in newest.iterdir()
        if p.name != "manifest.json"
    }
    manifest = {"format": 1, "step": 2, "files": files}
    (newest / "manifest.json").write_text(checkpoint.json.dumps(manifest))
    assert checkpoint.check_checkpoint(newest).intact
    _flip_a_byte(newest / "model.safetensors")
    assert "does not match its checksum" in checkpoint.check_checkpoint(newest).problem


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_found_and_passed_over(two_checkpoints, tmp_path, damage):
    older, newest = two_checkpoints
    harm, problem = DAMAGE[damage]
    harm(newest)
    chosen, damaged = checkpoint.intact_checkpoint(tmp_path)
    if problem is None:  # a checkpoint without a manifest still loads: used, not verified
        assert chosen.path == newest and chosen.intact and not chosen.verified
        return
    assert chosen.path == older and chosen.verified
    assert [c.path for c in damaged] == [newest] and problem in damaged[0].problem


def test_a_checkpoint_without_manifest_that_does_not_load_is_damaged(two_checkpoints):
    newest = two_checkpoints[1]
    (newest / "manifest.json").unlink()
    _truncate(newest / "model.safetensors")
    check = checkpoint.check_checkpoint(newest)
    assert not check.intact and "does not load" in check.problem


def test_with_no_intact_checkpoint_nothing_is_chosen(two_checkpoints, tmp_path):
    for path in two_checkpoints:
        _truncate(path / "model.safetensors")
    chosen, damaged = checkpoint.intact_checkpoint(tmp_path)
    assert chosen is None and [c.path for c in damaged] == two_checkpoints[::-1]


def test_checkpoints_command_lists_each_with_its_state(two_checkpoints, tmp_path, capsys):
    from treegrpo_ray.commands.cli import main

    run = tmp_path.parent / f"{tmp_path.name}-run"  # tmp_path itself holds the checkpoints
    checkpoint.shutil.move(tmp_path, run / "checkpoints")
    assert main(["checkpoints", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["step-000002", "step-000001"]
    assert "intact" in lines[0] and lines[0].endswith("<- latest")
    _flip_a_byte(run / "checkpoints" / "step-000001" / "model.safetensors")
    assert main(["checkpoints", str(run)]) == 1
    assert "damaged: model.safetensors does not match its checksum" in capsys.readouterr().out


def test_a_resume_with_no_intact_checkpoint_is_one_clear_error(two_checkpoints, tmp_path):
    from treegrpo_ray.cluster.train import use_intact_checkpoint
    from treegrpo_ray.config import JobConfig
    from treegrpo_ray.errors import UserInputError

    name = f"{tmp_path.name}-run"  # tmp_path itself holds the checkpoints
    cfg = JobConfig.model_validate({"name": name, "train": {"output_dir": str(tmp_path.parent)}})
    checkpoint.shutil.move(tmp_path, cfg.run_dir / "checkpoints")
    moved = [cfg.run_dir / "checkpoints" / p.name for p in two_checkpoints]
    _flip_a_byte(moved[1] / "model.safetensors")
    use_intact_checkpoint(cfg)  # the older one is intact: latest now names it
    assert checkpoint.latest_checkpoint(cfg.run_dir / "checkpoints") == moved[0]
    (moved[0] / "optimizer.pt").unlink()
    with pytest.raises(UserInputError, match="no intact checkpoint .*optimizer.pt is missing"):
        use_intact_checkpoint(cfg)


def test_a_checkpoint_the_disk_cannot_hold_stops_with_one_line_and_keeps_the_previous(
    tiny_cfg, untrained_policy, tmp_path, small_disk
):
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    learner.version = 1
    size = sum(
        f.stat().st_size
        for f in checkpoint.save_checkpoint(learner.state_dict(), tmp_path / "measure").iterdir()
    )
    run = small_disk(int(1.5 * size) + (64 << 10))  # room for one checkpoint, not two
    root = run / "checkpoints"
    first = checkpoint.save_checkpoint(learner.state_dict(), root)
    learner.version = 2
    with pytest.raises(checkpoint.CheckpointNotWritten) as stopped:
        checkpoint.save_checkpoint(learner.state_dict(), root)
    line = str(stopped.value)
    assert "\n" not in line
    assert f"checkpoint {root / 'step-000002'} could not be written: " in line
    assert "No space left on device" in line
    assert f"`treegrpo train --resume {run}` continues from update 1 ({first})" in line
    # the previous checkpoint is named by latest and intact; nothing of the new one is left
    assert checkpoint.latest_checkpoint(root) == first
    assert checkpoint.check_checkpoint(first).intact
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
