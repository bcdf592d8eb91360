"""treegrpo-ray: Tree-GRPO for LLM agents on Ray.

The pure algorithm lives in this folder. The rollout side, the learners, the job runtime, the
operator commands, the experiments and the tooling sit beside it in a checkout (``actors/``,
``learners/``, ``cluster/``, ``commands/``, ``experiments/``, ``tooling/``) and are installed as
this package's subpackages ``treegrpo_ray.actors``, ``.learners``, ``.cluster``, ``.commands``,
``.experiments``, ``.tooling``
(pyproject's ``package-dir``), so that no generic top-level name lands in site-packages. Adding
the checkout's root to ``__path__`` gives them the same names when the code runs from a checkout
(a Ray Jobs working directory, ``PYTHONPATH=.``); an installed copy already holds them.
"""

import ctypes
import os
from pathlib import Path

# torch's OpenMP threads otherwise spin at every barrier; on a shared machine a spinning thread
# burns the time slice of the thread it waits for (measured: 44% of a rollout worker's and a
# learner's CPU samples were spin-waits). Set before torch loads in every process that imports
# this package first; Ray Train workers get it through their runtime_env (cluster/train.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks of up to 32 MiB for reuse instead of unmapping them.

    By default glibc serves large blocks with fresh ``mmap`` pages and gives them back when freed,
    so every activation, logits or KV tensor a forward allocates is paid again in page faults: on
    this project's 2-core VMs a first touch ran at ~1 GB/s, and a learner update spent ~20% of its
    time, a decode step ~15%, faulting in pages. The price: a process keeps up to
    ``TRIM_THRESHOLD_BYTES`` of freed memory. Skipped with ``TREEGRPO_KEEP_FREED_MEMORY=0``, when
    the user set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (glibc's own tunables),
    and where there is no glibc. Returns whether it applied the setting.
    """
    tunables = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}
    if os.environ.get("TREEGRPO_KEEP_FREED_MEMORY") == "0" or tunables & os.environ.keys():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


keep_freed_memory()

_HERE = Path(__file__).resolve().parent
if not (_HERE / "actors").is_dir() and (_HERE.parent / "actors" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))
