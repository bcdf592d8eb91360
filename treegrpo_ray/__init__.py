"""treegrpo-ray: Tree-GRPO for LLM agents on Ray.

The pure algorithm lives in this folder. The rollout side, the learners and the orchestration sit
beside it in a checkout (``actors/``, ``learners/``, ``cluster/``) and are installed as this
package's subpackages ``treegrpo_ray.actors``, ``treegrpo_ray.learners``, ``treegrpo_ray.cluster``
(pyproject's ``package-dir``), so that no generic top-level name lands in site-packages. Adding
the checkout's root to ``__path__`` gives them the same names when the code runs from a checkout
(a Ray Jobs working directory, ``PYTHONPATH=.``); an installed copy already holds them.
"""

import os
from pathlib import Path

# torch's OpenMP threads otherwise spin at every barrier; on a shared machine a spinning thread
# burns the time slice of the thread it waits for (measured: 44% of a rollout worker's and a
# learner's CPU samples were spin-waits). Set before torch loads in every process that imports
# this package first; Ray Train workers get it through their runtime_env (cluster/train.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_HERE = Path(__file__).resolve().parent
if not (_HERE / "actors").is_dir() and (_HERE.parent / "actors" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))
