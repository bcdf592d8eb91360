"""``model.path`` as users write it: a local model directory or a Hugging Face Hub id.

A Hub id (``Qwen/Qwen2.5-3B-Instruct``) names the snapshot that the Hugging Face cache of the
process loading the model holds for the repository's ``main`` ref. The cache is per node, so every
loader (``treegrpo_ray.modeling``, the vLLM engine) resolves the id where it runs: the driver's
check, each rollout worker and each learner on its own node. A cached snapshot is used as is (no
network call, so the nodes of one job cannot drift to different revisions mid-run); a missing one
is downloaded (config, safetensors weights, tokenizer files), unless ``HF_HUB_OFFLINE=1`` forbids
any network attempt. The cache is where ``HF_HUB_CACHE`` (or ``HF_HOME``/hub) says, as for ``hf``.
"""

from __future__ import annotations

import socket
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from treegrpo_ray.errors import UserInputError

# What a policy needs from a Hub repository: config, safetensors weights and their index,
# tokenizer files, chat template. Not other weight formats (Llama's original/*.pth, *.bin).
POLICY_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def resolve_policy_path(path: str | Path) -> Path:
    """The local directory of ``model.path``: an existing directory (absolute), or the snapshot
    of a Hub id in this node's Hugging Face cache (downloaded there when missing and online).

    Raises UserInputError naming the fix: a local path that does not exist, or a Hub id that is
    neither cached on this node nor downloadable (offline, unreachable, unknown or gated).
    """
    local = Path(path).expanduser()
    if local.is_dir():
        return local.resolve()
    if not is_hub_id(str(path)):
        raise UserInputError(
            f"model.path: policy directory {local} does not exist; point model.path at a "
            "directory written by save_pretrained or a Hugging Face Hub id (Org/Name), or set "
            "model.path=null to warm-start the tiny model"
        )
    return _hub_snapshot(str(path))


def is_hub_id(text: str) -> bool:
    """``Org/Name`` spelled as the Hub spells ids, and not a path: no leading ``/``, ``.`` or
    ``~``, exactly one ``/``, and no existing directory named like the organisation (``runs/x``
    next to a ``runs/`` folder is a mistyped path)."""
    org, slash, _ = text.partition("/")
    if not slash or text.startswith(("/", ".", "~")) or Path(org).exists():
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot of ``repo_id``; downloads it first when missing and online."""
    try:
        return Path(snapshot_download(repo_id, allow_patterns=POLICY_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        missing = (
            f"model.path: {repo_id} has no complete snapshot in the Hugging Face cache of node "
            f"{socket.gethostname()} ({constants.HF_HUB_CACHE})"
        )
    fix = (
        f"download it into the cache on every node (hf download {repo_id}) or point model.path "
        "at a local model directory"
    )
    if constants.is_offline_mode():
        raise UserInputError(f"{missing} and HF_HUB_OFFLINE is set; {fix}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=POLICY_FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError) as err:
        cause = err.__cause__ or err
        first_line = str(cause).strip().partition("\n")[0]
        raise UserInputError(
            f"{missing} and could not be downloaded ({type(cause).__name__}: {first_line}); {fix}"
        ) from err
