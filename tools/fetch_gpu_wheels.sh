#!/usr/bin/env bash
# Fills ./wheels with what tools/gpu_check.sh installs, when missing, on the GPU check machine
# (Python 3.12, x86-64, no network; torch and numpy preinstalled, and pyyaml and safetensors too):
# megatron-core 0.16.1 (the version this package is built and tested against; its only runtime
# needs are torch, numpy, packaging), omegaconf 2.4.0 (recipes; antlr4 is vendored in it), and, in
# case an image lacks them, pyyaml and safetensors. About 4 MB together; ./wheels is git-ignored:
# carry it in the device run (carry: ["wheels"]). Run on a machine that reaches PyPI:
#   bash tools/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
mkdir -p wheels
rm -f wheels/*.whl  # one version of each: two make pip refuse the install
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d wheels "megatron-core==0.16.1" "omegaconf==2.4.0" \
  "pyyaml==6.0.4" "safetensors==0.8.0"
ls -l wheels/*.whl
du -ch wheels/*.whl | tail -1
