#!/usr/bin/env bash
# One prepared check for a single-H200 machine without network (Python 3.12, torch 2.11 + CUDA
# preinstalled; megatron-core travels as a wheel in ./wheels if not installed; no TE, no vLLM).
# Measures the Qwen3-0.6B-shaped model's fp32-vs-bf16 and fp32-vs-fp16 beta (overall and by token
# rarity) with Megatron's local spec and torch autocast, then runs a few GRPO-style steps
# (shadow forward + loss + backward + AdamW) on random "rollouts". Writes results to $1.
#   bash tools/gpu_check.sh OUT_DIR          (target: under 8 minutes)
set -euo pipefail
out="${1:?usage: tools/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
python -c "import megatron.core" 2>/dev/null || pip install --no-deps --no-index wheels/megatron_core-*.whl
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
timeout 480 python tools/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.log"
