"""Benchmark: what each diagnostic costs per step, side by side in one run.

Trains RECIPE (default: the tiny EOS job) with every diagnostic on, an fp32 trainer and a bf16
generator (so the shadow forward is a real extra forward), and times inside the same steps: the
whole step, generation, the train phase (shadow forward + forward-backward + optimizer + probe), the
shadow forward, the deployed-improvement probe and the parity probe (``timing/parity_s``). Prints
the mean seconds per step over the steps after the first (warm-up) and each one's share of a step.

    python tools/bench/bench_diagnostics.py [--backend megatron|vllm] [--steps 6] [key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def instrument(stepper, seconds):
    """Wraps the step's shadow forward and its low-precision forwards: a low-precision forward inside
    ``run`` but outside the shadow forward is the deployed-improvement probe."""
    run, shadow_forward, lowp = stepper.run, stepper._shadow_forward, stepper.lowp_log_probs
    where = {"run": False, "shadow": False}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync()
            seconds[name].append(time.perf_counter() - start)
            return out
        return wrapper

    def run_wrapper(*args, **kwargs):
        where["run"] = True
        try:
            return run(*args, **kwargs)
        finally:
            where["run"] = False

    def shadow_wrapper(*args, **kwargs):
        where["shadow"] = True
        try:
            return timed("shadow", shadow_forward)(*args, **kwargs)
        finally:
            where["shadow"] = False

    def lowp_wrapper(*args, **kwargs):
        if where["run"] and not where["shadow"]:
            return timed("probe", lowp)(*args, **kwargs)
        return lowp(*args, **kwargs)

    stepper.run, stepper._shadow_forward, stepper.lowp_log_probs = run_wrapper, shadow_wrapper, lowp_wrapper


def mean_after_warmup(values):
    values = list(values)[1:] or list(values)
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml"))
    parser.add_argument("--backend", default="megatron", choices=("megatron", "vllm"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    args = parser.parse_args()

    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.trainer.loop import GRPOTrainer

    log_dir = tempfile.mkdtemp(prefix="bench-diagnostics-")
    overrides = [f"generation.backend={args.backend}", f"grpo.max_num_steps={args.steps}",
                 "policy.precision.generation_dtype=bfloat16", "grpo.deployed_improvement=true",
                 "grpo.diagnostics_every=1", "generation.parity_probe_every=1", f"logger.log_dir={log_dir}",
                 "logger.progress_bar=false", "logger.tensorboard=false", *args.overrides]
    trainer = GRPOTrainer(load_recipe(args.recipe, overrides))
    seconds = collections.defaultdict(list)
    instrument(trainer.ctx.stepper, seconds)
    trainer.train()
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    step = mean_after_warmup(r["time/step_s"] for r in rows)
    parts = {
        "generate": mean_after_warmup(r["timing/generate_s"] for r in rows),
        "train (all below + fwd-bwd + optimizer)": mean_after_warmup(r["timing/train_s"] for r in rows),
        "  shadow forward": mean_after_warmup(seconds["shadow"]),
        "  deployed-improvement probe": mean_after_warmup(seconds["probe"]),
        "weight push": mean_after_warmup(r["timing/weight_push_s"] for r in rows),
        "parity probe": mean_after_warmup(r["timing/parity_s"] for r in rows),
    }
    print(f"\nbackend={args.backend}, {args.steps} steps, mean over steps 2..{args.steps} "
          f"(fp32 trainer, bf16 generator and shadow)")
    print(f"{'step':<42}{step:8.3f} s")
    for name, value in parts.items():
        print(f"{name:<42}{value:8.3f} s  {value / step:6.1%}")


if __name__ == "__main__":
    main()
