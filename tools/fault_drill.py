"""Fault drill: inject the faults a long RL run meets and count what was lost.

Each drill runs the tiny recipe (CPU) with a checkpoint every step:
  1. SIGKILL between steps 3 and 4, then ``checkpointing.resume=true``;
  2. the vLLM generator process killed before step 2 (in-process backend);
  3. the vLLM server killed before step 2 (server backend);
  4. a NaN in one micro-batch's log-probs at step 2.
Prints, last, faults injected / runs recovered / steps lost / metric rows lost.

    python tools/fault_drill.py [--model DIR] [--out runs/fault-drill]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5


def run(args, log_dir, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "megatron_grpo", "train", "recipes/grpo-tiny-eos-cpu.yaml",
           f"logger.log_dir={log_dir}", "logger.progress_bar=false", f"grpo.max_num_steps={STEPS}"] + args
    code = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).returncode
    path = os.path.join(log_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.isfile(path) else []
    return code, rows


def drill(name, out, model, fault_env, resume=False, extra=()):
    log_dir, ck = os.path.join(out, name), os.path.join(out, name + "-ckpt")
    base = [f"policy.model_name={model}", "checkpointing.save_period=1", f"checkpointing.checkpoint_dir={ck}"]
    base += list(extra)
    code, rows = run(base, log_dir, fault_env)
    if resume and code != 0:
        code, rows = run(base + ["checkpointing.resume=true"], log_dir)
    steps = [r["step"] for r in rows]
    recovered = code == 0 and steps == list(range(1, STEPS + 1))
    return {"drill": name, "recovered": recovered, "steps_lost": STEPS - len(set(steps)),
            "rows_lost": STEPS - len(steps) if len(steps) <= STEPS else 0, "duplicate_rows": len(steps) - len(set(steps))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a fresh tiny Qwen3)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="fault-drill-")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    model = args.model
    if model is None:
        from megatron_grpo.models.tiny import make_tiny_model

        model = make_tiny_model(os.path.join(out, "tiny-model"), "qwen3")
    results = [
        drill("sigkill-step3", out, model, {"MEGATRON_GRPO_FAULT_KILL_AFTER_STEP": "3"}, resume=True),
        drill("generator-killed", out, model, {"MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP": "2"}),
        drill("server-killed", out, model, {"MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP": "2"},
              extra=["generation.backend=vllm_server", "generation.retry_timeout_s=5"]),
        drill("nan-log-probs", out, model, {"MEGATRON_GRPO_FAULT_NAN_STEP": "2"}),
    ]
    for r in results:
        print(f"{r['drill']:>18}: recovered={r['recovered']} steps_lost={r['steps_lost']} rows_lost={r['rows_lost']} "
              f"duplicate_rows={r['duplicate_rows']}")
    print(f"faults injected: {len(results)}, runs recovered: {sum(r['recovered'] for r in results)}, "
          f"steps lost: {sum(r['steps_lost'] for r in results)}, metric rows lost: {sum(r['rows_lost'] for r in results)}")
    return 0 if all(r["recovered"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
