"""Learner checkpoints on disk, written so that a crash never leaves them unusable.

A checkpoint directory holds a ``LearnerState`` (``Learner.state_dict``): the trainable weights
(the whole model, or with LoRA only the adapter), the optimizer state, the torch RNG state and
``trainer_state.json`` (the learner's counters and whatever the caller adds, such as the data
cursor). Checkpoints go to ``ROOT/step-NNNNNN``: each is written to a temporary directory and
renamed into place, then ``ROOT/latest`` (a one-line file) is replaced atomically to name it, so
until the new one is complete ``latest`` names the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LATEST = "latest"
KEEP = 2  # complete checkpoints kept on disk (the newest ones)


@dataclass
class LearnerState:
    """A learner's whole training state.

    weights: the model's state dict, or with ``adapter`` the LoRA adapter's; optimizer: its state
    dict; torch_rng: ``torch.get_rng_state()``; counters: JSON values (policy version,
    skipped-update counters, Python RNG state, reward normaliser, and the caller's extras)."""

    weights: dict[str, torch.Tensor]
    adapter: bool
    optimizer: dict[str, Any]
    torch_rng: torch.Tensor
    counters: dict[str, Any]

    @property
    def version(self) -> int:
        return int(self.counters["policy_version"])


def save_checkpoint(state: LearnerState, root: Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``state`` (plus ``extra`` counters) as ``root/step-<version>``; point
    ``root/latest`` at it."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.version:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _write_state(state, tmp, extra or {})
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


def load_checkpoint(path: Path) -> LearnerState:
    """The state saved in ``path``; its counters include the extras given when it was saved."""
    counters = json.loads((path / "trainer_state.json").read_text())
    counters["python_rng"] = _as_tuple(counters["python_rng"])
    adapter = (path / "adapter.safetensors").is_file()
    weights = load_file(str(path / ("adapter.safetensors" if adapter else "model.safetensors")))
    for alias, name in counters.pop("aliases").items():
        weights[alias] = weights[name]
    return LearnerState(
        weights=weights,
        adapter=adapter,
        optimizer=torch.load(path / "optimizer.pt", weights_only=True),
        torch_rng=torch.load(path / "torch_rng.pt", weights_only=True),
        counters=counters,
    )


def _write_state(state: LearnerState, directory: Path, extra: dict[str, Any]) -> None:
    weights, aliases = _without_aliases(state.weights)
    name = "adapter.safetensors" if state.adapter else "model.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, directory / name)
    torch.save(state.optimizer, directory / "optimizer.pt")
    torch.save(state.torch_rng, directory / "torch_rng.pt")
    counters = {**extra, **state.counters, "aliases": aliases}
    (directory / "trainer_state.json").write_text(json.dumps(counters))


def _without_aliases(
    weights: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tied weights (one tensor under two names, e.g. embeddings and LM head) stored once:
    the distinct tensors, and each alias's name -> the name it is stored under."""
    seen: dict[tuple, str] = {}
    distinct, aliases = {}, {}
    for name, tensor in weights.items():
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            distinct[name] = tensor
    return distinct, aliases


def _as_tuple(value: Any) -> Any:
    """JSON turned ``random.getstate()``'s tuples into lists; ``setstate`` wants tuples."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _drop_old(root: Path, newest: str) -> None:
    """Keep the ``KEEP`` newest complete checkpoints (names sort by step)."""
    steps = sorted(p.name for p in root.glob("step-*") if p.is_dir())
    for name in steps[: max(len(steps) - KEEP, 0)]:
        if name != newest:
            shutil.rmtree(root / name, ignore_errors=True)
