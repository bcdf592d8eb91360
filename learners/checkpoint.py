"""The learner's full training state on disk, written so that a crash never leaves it unusable.

A checkpoint directory holds the trainable weights (the whole model, or with LoRA only the
adapter), the optimizer state, the Python and torch RNG states and ``trainer_state.json`` (policy
version, skipped-update counters, the per-depth reward normaliser and whatever the caller adds,
such as the data cursor). Checkpoints go to ``ROOT/step-NNNNNN``: each is written to a temporary
directory and renamed into place, then ``ROOT/latest`` (a one-line file) is replaced atomically to
name it, so until the new one is complete ``latest`` names the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

LATEST = "latest"
KEEP = 2  # complete checkpoints kept on disk (the newest ones)


def save_checkpoint(learner: Any, root: Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``learner``'s state as ``root/step-<version>`` and point ``root/latest`` at it."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{learner.version:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _write_state(learner, tmp, extra or {})
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    _drop_old(root, final.name)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when there is none yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    return root / pointer.read_text().strip()


def load_checkpoint(learner: Any, path: Path) -> dict[str, Any]:
    """Restore ``learner`` from ``path``; returns the checkpoint's ``trainer_state.json``."""
    if learner.lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(learner.model, load_file(str(path / "adapter.safetensors")))
    else:
        load_model(learner.model, str(path / "model.safetensors"))
    learner.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    torch.set_rng_state(torch.load(path / "torch_rng.pt", weights_only=True))
    state = json.loads((path / "trainer_state.json").read_text())
    learner.rng.setstate(_as_tuple(state["python_rng"]))
    learner.version = state["policy_version"]
    learner.skipped_updates = state["skipped_updates"]
    learner.skipped_in_a_row = state["skipped_in_a_row"]
    if learner.reward_norm is not None:
        learner.reward_norm.load_state_dict(state["reward_norm"])
    return state


def _write_state(learner: Any, directory: Path, extra: dict[str, Any]) -> None:
    if learner.lora:
        from peft import get_peft_model_state_dict

        adapter = get_peft_model_state_dict(learner.model)
        save_file(
            {k: v.contiguous() for k, v in adapter.items()}, directory / "adapter.safetensors"
        )
    else:
        save_model(learner.model, str(directory / "model.safetensors"))  # handles tied weights
    torch.save(learner.optimizer.state_dict(), directory / "optimizer.pt")
    torch.save(torch.get_rng_state(), directory / "torch_rng.pt")
    state = {
        **extra,
        "policy_version": learner.version,
        "skipped_updates": learner.skipped_updates,
        "skipped_in_a_row": learner.skipped_in_a_row,
        "python_rng": learner.rng.getstate(),
        "reward_norm": None if learner.reward_norm is None else learner.reward_norm.state_dict(),
    }
    (directory / "trainer_state.json").write_text(json.dumps(state))


def _as_tuple(value: Any) -> Any:
    """JSON turned ``random.getstate()``'s tuples into lists; ``setstate`` wants tuples."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _drop_old(root: Path, newest: str) -> None:
    """Keep the ``KEEP`` newest complete checkpoints (names sort by step)."""
    steps = sorted(p.name for p in root.glob("step-*") if p.is_dir())
    for name in steps[: max(len(steps) - KEEP, 0)]:
        if name != newest:
            shutil.rmtree(root / name, ignore_errors=True)
