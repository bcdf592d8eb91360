#!/usr/bin/env bash
# The device check (issue 30; README "Checking a GPU machine"): from a source checkout, nothing
# installed, no Ray or vLLM needed; what it measures goes to $OUT (default runs/device-check).
# Needs torch, transformers, peft, pyarrow, pydantic, pyyaml, safetensors, xxhash and pytest importable
# by $PYTHON (default python3).
# Without CUDA the CUDA parts are skipped, each with the reason, and the rest runs (CI runs it so).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/device-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'available', torch.cuda.is_available(), '| transformers', \
transformers.__version__)"
} 2>&1 | tee "$OUT/environment.txt"
# the gpu-marked tests that need neither Ray nor vLLM: the embedded engine and the learner on CUDA
"$PYTHON" -m pytest -q --tier all -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" || status=1
"$PYTHON" -m benchmarks.device_check --out "$OUT" 2>&1 | tee "$OUT/device-check.log" || status=1
echo "device check: $([ $status = 0 ] && echo passed || echo FAILED), results in $OUT"
exit $status
