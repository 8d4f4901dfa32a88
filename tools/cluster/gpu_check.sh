#!/usr/bin/env bash
# The one prepared check for a single-H200 machine without network (Python 3.12, torch + CUDA,
# safetensors / pyyaml preinstalled; no megatron-core, omegaconf, TE or vLLM). Named phases, in order
# (tools/cluster/gpu_check.py): preflight (versions, device, disk, wheels, imports; fails fast), smoke (one
# bf16 train step of a tiny model), beta (fp32-vs-bf16/fp16 log-prob gaps by rarity bucket, and each
# precision's error vs an fp64 forward), fp8 (the FP8 kernel residual: our emulated FP8 GEMM vs
# torch._scaled_mm's on the same bytes, per linear and in log-probs, beside the FP8 gap and the emulation's
# own fp32 noise), A (bf16 trainer + bf16 generator: beta = 0), shadow (A with
# a forced fp16 shadow forward: beta finite and > 0), fp16 (fp16 trainer + fp16 generator, loss
# scaling: beta = 0) and B (fp32 trainer vs bf16 generator: beta > 0), each a real
# `python -m megatron_grpo train` with generation.backend=megatron on a random-init Qwen3-0.6B-shaped
# model. A phase that does not fit the remaining time is skipped (recorded), not started.
#
#   bash tools/cluster/fetch_gpu_wheels.sh                 # here, once (PyPI): fills ./wheels (~21 MB)
#   bash tools/cluster/gpu_check.sh OUT_DIR                # there, with ./wheels carried; under 8 minutes
#   GPU_CHECK_PHASES=preflight,smoke,beta bash tools/cluster/gpu_check.sh OUT_DIR   # a subset (preflight,fp8: FP8 alone)
#   GPU_CHECK_DRY=1 bash tools/cluster/gpu_check.sh OUT    # CPU, tiny model, 2 steps per run (CI)
#
# The device run carries the working tree plus ./wheels: 64 MiB at most in all (the tree is ~2 MB;
# fetch_gpu_wheels.sh refuses wheels that would not fit). OUT_DIR receives small files only:
# gpu_check.json (rewritten atomically before and after each phase: a killed run leaves a valid
# JSON of the phases done so far, its `not_measured` list says what was not measured and why),
# gpu_check.log, run_{smoke,A,shadow,fp16,B}.metrics.jsonl. Checkpoints and run folders go to
# $GPU_CHECK_WORK (default: a new temporary folder; removed after a dry run). Python: $PYTHON, else
# .venv/bin/python, else python3. Exit status 0 only when every phase that ran is ok; otherwise
# non-zero with "gpu_check: FAILED: ..." printed.
set -euo pipefail
out="${1:?usage: tools/cluster/gpu_check.sh OUT_DIR   (GPU_CHECK_DRY=1 for the CPU dry run)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/../.."
limit=480  # the device session (its 15 minutes hold the machine's start and this run)
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
# A failure before tools/cluster/gpu_check.py wrote its JSON (a missing wheel, a broken pip) still leaves one.
fail() {
  echo "gpu_check: FAILED: $*" >&2
  if [ ! -f "$out/gpu_check.json" ]; then
    GPU_CHECK_ERROR="$*" "$py" -c 'import json, os, sys
e = os.environ["GPU_CHECK_ERROR"]
json.dump({"ok": False, "stage": "shell", "error": e, "phases": {},
           "not_measured": ["every phase: the shell stage failed before tools/cluster/gpu_check.py ran: " + e]},
          open(sys.argv[1] + ".tmp", "w"), indent=1)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])' "$out/gpu_check.json" 2>/dev/null || true
  fi
  exit 1
}
dry="${GPU_CHECK_DRY:-0}"
[ "$dry" = 0 ] && dry_flag=() || dry_flag=(--dry)
[ "$dry" = 0 ] || limit=900  # the CPU dry run (CI): seven processes importing megatron on a loaded 2-core machine

# What the train path (generation.backend=megatron) imports beyond torch and the machine may lack
# (numpy too: megatron.core needs it and a torch install does not bring it): module -> wheel name in
# ./wheels (tools/cluster/fetch_gpu_wheels.sh). Checked without importing
# them (megatron.core's import alone takes seconds); only the missing ones are installed, from
# ./wheels alone (no index, no deps), into a folder put on PYTHONPATH. yaml and safetensors are
# preinstalled there; transformers / tokenizers are not needed (token-id prompts, no tokenizer).
needs=(numpy:numpy megatron.core:megatron_core packaging:packaging omegaconf:omegaconf yaml:pyyaml safetensors:safetensors)
wheels="${GPU_CHECK_WHEELS:-wheels}"
missing=()
for spec in "${needs[@]}"; do
  probe="import importlib.util, sys; sys.exit(importlib.util.find_spec('${spec%%:*}') is None)"
  if ! "$py" -c "$probe" 2>/dev/null; then
    missing+=("${spec#*:}")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  files=()
  absent=()  # every missing wheel is named at once
  shopt -s nocaseglob
  for name in "${missing[@]}"; do
    match=("$wheels"/"$name"-*.whl)
    if [ -f "${match[0]}" ]; then files+=("${match[@]}"); else
      absent+=("$name is not installed and $wheels/$name-*.whl is missing"); fi
  done
  if [ "${#absent[@]}" -gt 0 ]; then
    joined="$(printf '%s; ' "${absent[@]}")"
    fail "${joined%; }: run 'bash tools/cluster/fetch_gpu_wheels.sh' on a machine with PyPI and carry the wheels folder"
  fi
  site="${TMPDIR:-/tmp}/megatron_grpo_gpu_site"
  echo "gpu_check: installing ${missing[*]} from $wheels into $site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --upgrade \
    --target "$site" "${files[@]}" || fail "pip could not install ${files[*]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  GPU_CHECK_INSTALLED="$(for f in "${files[@]}"; do basename "$f"; done | tr '\n' ' ')"
  export GPU_CHECK_INSTALLED  # preflight records which wheels were installed
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

work="${GPU_CHECK_WORK:-}"
if [ -z "$work" ]; then
  work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
  [ "$dry" = 0 ] || trap 'rm -rf "$work"' EXIT
fi
left=$((limit - SECONDS))
rc=0
timeout -k 10 "$left" "$py" tools/cluster/gpu_check.py --out "$out" --work "$work" --budget $((left - 10)) \
  --phases "${GPU_CHECK_PHASES:-}" "${dry_flag[@]}" \
  2>&1 | tee "$out/gpu_check.log" || rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  fail "did not finish within $limit s (see $out/gpu_check.log; $out/gpu_check.json holds the phases done)"
elif [ "$rc" -ne 0 ]; then
  fail "tools/cluster/gpu_check.py exited with status $rc (the reasons are printed above; log: $out/gpu_check.log)"
fi
