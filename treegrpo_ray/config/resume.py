"""A run's saved config (``RUN_DIR/config.yaml``) and resuming from it: ``resume_config``
reloads it and accepts only the changes in ``RESUMABLE_CHANGES``."""

from __future__ import annotations

import copy
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml

from treegrpo_ray.config.loading import read_yaml, validate
from treegrpo_ray.config.schema import JobConfig
from treegrpo_ray.errors import UserInputError

RUN_CONFIG_FILE = "config.yaml"
# Fields a resumed run may change: where it runs and how long, not what it learns from.
RESUMABLE_CHANGES = (
    "name",
    "train.output_dir",
    "train.steps",
    "train.eval_every",
    "train.eval_questions",
    "train.checkpoint_every",
    "train.save_trees_every",
    "train.queue_timeout_s",
    "ppo.lr",
    "ppo.grad_clip",
    "ppo.micro_batch_tokens",
    "ppo.trees_per_row",
    "cluster.*",
    "engine.*",
)


def save_run_config(cfg: JobConfig) -> None:
    """Write the run's resolved config to ``RUN_DIR/config.yaml`` (what ``--resume`` reads)."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    (cfg.run_dir / RUN_CONFIG_FILE).write_text(text)


def resume_config(
    run_dir: Path, name_or_path: str | None, overrides: list[str] | None = None
) -> JobConfig:
    """The config of a resumed run: the one saved in ``run_dir`` (or ``name_or_path``, which must
    agree with it) plus ``overrides``, writing to ``run_dir``.

    Only the fields in ``RESUMABLE_CHANGES`` may differ from the saved config; any other
    difference is a ``UserInputError`` that names the fields."""
    saved_file = run_dir / RUN_CONFIG_FILE
    if not saved_file.is_file():
        raise UserInputError(
            f"cannot resume {run_dir}: it has no {RUN_CONFIG_FILE}; pass the directory of a run "
            "started by `treegrpo train` (OUTPUT_DIR/NAME)"
        )
    saved = read_yaml(str(saved_file))
    data = read_yaml(name_or_path) if name_or_path else copy.deepcopy(saved)
    place = [f"name={run_dir.name}", f"train.output_dir={run_dir.resolve().parent}"]
    cfg = validate(data, list(overrides or []) + place, name_or_path or str(saved_file))
    cfg = cfg.with_absolute_paths()
    previous = validate(saved, place, str(saved_file)).with_absolute_paths()
    changed = changed_fields(previous.model_dump(mode="json"), cfg.model_dump(mode="json"))
    frozen = [f for f in changed if not any(fnmatch(f, p) for p in RESUMABLE_CHANGES)]
    if frozen:
        raise UserInputError(
            f"cannot resume {run_dir} with a different {', '.join(frozen)} than it was started "
            f"with (see {saved_file}); a resumed run may change only "
            + ", ".join(RESUMABLE_CHANGES)
        )
    return cfg


def changed_fields(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the leaves that differ between two nested dicts of the same schema."""
    changed = []
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            changed += changed_fields(old[key], value, f"{prefix}{key}.")
        elif old.get(key) != value:
            changed.append(f"{prefix}{key}")
    return changed
