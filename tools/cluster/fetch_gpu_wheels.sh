#!/usr/bin/env bash
# Fills ./wheels with what tools/cluster/gpu_check.sh installs, when missing, on the GPU check machine
# (Python 3.12, x86-64, no network; torch preinstalled, and pyyaml and safetensors too):
# megatron-core 0.16.1 (the version this package is built and tested against; its only runtime
# needs are torch, numpy, packaging: neither numpy nor packaging is a torch dependency, so both come
# too; numpy 2.3.5 as in this repo's venv), omegaconf 2.4.0 (recipes; antlr4 is vendored in it), and,
# in case an image lacks them, pyyaml and safetensors. About 21 MB together (numpy ~17 MB; gpu_check.sh
# installs only what the machine lacks); ./wheels is git-ignored:
# carry it in the device run (carry: ["wheels"]). The device run carries at most 64 MiB in all (the
# working tree's tracked + untracked files, ~2 MB, plus the carried paths): this script fails when the
# wheels pass WHEELS_MAX_MIB (24) or the tree plus the wheels pass 64 MiB (no TE / vLLM wheels: they
# are hundreds of MB). Run on a machine that reaches PyPI:
#   bash tools/cluster/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
mkdir -p wheels
rm -f wheels/*.whl  # one version of each: two make pip refuse the install
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d wheels "numpy==2.3.5" "megatron-core==0.16.1" "packaging==25.0" \
  "omegaconf==2.4.0" "pyyaml==6.0.4" "safetensors==0.8.0"
ls -l wheels/*.whl
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
wheel_bytes=$(stat -c %s wheels/*.whl | awk '{s += $1} END {print s + 0}')
tree_bytes=0
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then  # what the device run copies besides wheels
  # (|| true: a tracked file deleted but not yet committed has no size, and stat's failure must not stop us)
  tree_bytes=$( { git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null || true; } \
    | awk '{s += $1} END {print s + 0}')
fi
echo "fetch_gpu_wheels: wheels $(mib "$wheel_bytes") MiB + working tree $(mib "$tree_bytes") MiB (the device carry: 64 MiB)"
if [ "$wheel_bytes" -gt $(( ${WHEELS_MAX_MIB:-24} * 1048576 )) ]; then
  echo "fetch_gpu_wheels: FAILED: wheels/ is $(mib "$wheel_bytes") MiB > ${WHEELS_MAX_MIB:-24} MiB" >&2; exit 1
fi
if [ $(( wheel_bytes + tree_bytes )) -gt $(( 64 * 1048576 )) ]; then
  echo "fetch_gpu_wheels: FAILED: working tree + wheels = $(mib $(( wheel_bytes + tree_bytes ))) MiB > the 64 MiB" \
    "device carry: remove large untracked files from the tree" >&2; exit 1
fi
