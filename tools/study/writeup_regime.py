"""Issue 26: the write-up's failure in the write-up's regime, pre-registered and gated.

``python tools/study/writeup_regime.py --out runs/writeup-regime`` (or ``python tools/study/sweep.py --grid writeup-regime
...``, which hands its arguments to this tool) runs, in order (each run
resumable; the criteria are fixed in ``docs/results/preregistration-writeup-regime.md`` before any
main run, and the constants below are the ones that page states):

1. ``probe``: ``scout-B`` (run B at the scout eps, per-token dumps) whose measured log-ratios set the
   main eps (:func:`eps_for_fraction`: P(ratio outside [1-eps, 1+eps]) = :data:`TARGET_PHANTOM`) and
   the dose eps; then ``probe-A`` and ``probe-B`` at that eps, checked by :func:`gates`;
2. ``main`` (only if every gate passes, or with ``--run-flagged``): A vs B, :data:`MAIN_SEEDS` x
   :data:`MAIN_STEPS` steps;
3. ``dose``: F (ratio 1: dose 0), B at the 1x and 2x phantom doses, :data:`DOSE_SEEDS` x
   :data:`DOSE_STEPS` steps;
4. writes ``OUT/writeup-regime.md`` after every stage (``--page DOC`` or ``tools/study/report.py OUT --regime DOC``
   rewrites it anywhere, ``--export DIR`` copies every run's raw metrics.jsonl), verdicts by :func:`decide`.

Every run: ``generation.backend=megatron`` (the trainer's own model generates: alpha is exact, no vLLM
kernel residual), synchronous (``max_staleness=0``: the rollout's weights are the trainer's, so alpha = 0
at every step and every clipped token is phantom-clipped), lr :data:`LR`.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_grpo.observe import experiments
from megatron_grpo.observe.experiments import ci95, fmt_ci, md_table, paired_diffs, read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
RECIPE = experiments.WRITEUP_RECIPE

PREREG = "docs/results/preregistration-writeup-regime.md"
LR = 1e-4
"""The smallest lr of the previous scan at which A still improved within 30 steps (docs/results/
writeup-reproduction.md); synchronous runs have alpha = 0 at any lr, so the gates do not constrain it."""
SCOUT_EPS = 0.016
"""The scout's eps (the previous page's 0.01595): only its dumped log-ratios are used."""
TARGET_PHANTOM = 0.15
"""The main eps puts this share of B's tokens outside the trust region (the write-up: 13.5-17.2% early)."""
DOSE_TARGETS = {"B-dose15": 0.15, "B-dose30": 0.30}
"""Dose-response: B at the 1x and the 2x phantom dose (F is dose 0)."""
PHANTOM_GATE, LEGIT_MAX, SNR_MAX = (0.10, 0.20), 0.02, 1.0
"""Gates on the probes: B's phantom region fraction, its legit region fraction, its SNR."""
PROBE_STEPS, MAIN_STEPS, DOSE_STEPS = 3, 70, 40
MAIN_SEEDS, DOSE_SEEDS = (0, 1, 2, 3), (0, 1, 2)
FINAL_LAST = 10
"""Primary metric: mean reward over the last 10 steps, A - B paired by seed."""
EQUIV_D = 1.5
"""Equivalence bound d (reward units = tokens of completion length), also the minimum effect X."""
MIN_A_GAIN = 3.0
"""Validity: A's final-10 reward minus its steps 1-5 mean must reach 2 d, else there is no failure to show."""
THRESHOLD = -4.0

_BASE = ["generation.backend=megatron", "generation.max_staleness=0", f"policy.megatron_cfg.optimizer.lr={LR:g}"]
_A = ["policy.precision.compute_dtype=bfloat16", "policy.precision.generation_dtype=bfloat16"]
_B = ["policy.precision.compute_dtype=float32", "policy.precision.generation_dtype=bfloat16"]
"""The write-up's A (bf16 trainer = bf16 generator) and B (fp32 trainer vs bf16 generator), as tools/study/writeup.py's."""
RUNS: Dict[str, List[str]] = {
    "scout-B": _BASE + _B + [f"loss_fn.ratio_clip_min={SCOUT_EPS:g}", f"loss_fn.ratio_clip_max={SCOUT_EPS:g}",
                             f"logger.token_dump_steps=[{','.join(str(s) for s in range(1, PROBE_STEPS + 1))}]"],
    "probe-A": _BASE + _A, "probe-B": _BASE + _B,
    "A": _BASE + _A, "B": _BASE + _B, "F": _BASE + _B + ["loss_fn.ratio=one"],
    "B-dose15": _BASE + _B, "B-dose30": _BASE + _B,
}
"""Overrides of :data:`RECIPE` per run; the clip eps (but the scout's) comes first from the probe."""
STAGES = {"probe": (["scout-B"], (0,), PROBE_STEPS), "gates": (["probe-A", "probe-B"], (0,), PROBE_STEPS),
          "main": (["A", "B"], MAIN_SEEDS, MAIN_STEPS), "dose": (["F", *DOSE_TARGETS], DOSE_SEEDS, DOSE_STEPS)}
"""stage -> (runs, seeds, steps); folders ``OUT/<stage>/<run>/seed<k>``."""


def grid() -> Dict[str, List[str]]:
    return dict(RUNS)


def eps_overrides(eps: float) -> List[str]:
    return [f"loss_fn.ratio_clip_min={eps:.4g}", f"loss_fn.ratio_clip_max={eps:.4g}"]


# ----------------------------------------------------------------------------- eps from the beta sample

def outside_distance(log_ratio: float) -> float:
    """How far exp(log_ratio) lies from 1 on its side: the token is outside [1-eps, 1+eps] iff this > eps."""
    r = math.exp(max(min(log_ratio, 20.0), -20.0))
    return r - 1.0 if r >= 1.0 else 1.0 - r


def fraction_outside(log_ratios: Sequence[float], eps: float) -> float:
    return sum(outside_distance(x) > eps for x in log_ratios) / len(log_ratios)


def eps_for_fraction(log_ratios: Sequence[float], target: float) -> float:
    """The eps that puts ``target`` of the tokens outside the trust region (midway between neighbours)."""
    if not log_ratios or not 0.0 < target < 1.0:
        raise ValueError(f"eps_for_fraction: need tokens and 0 < target < 1 (got {len(log_ratios)}, {target})")
    dist = sorted((outside_distance(x) for x in log_ratios), reverse=True)
    k = max(1, min(len(dist) - 1, round(target * len(dist))))
    return 0.5 * (dist[k - 1] + dist[k])


def load_log_ratios(run_dir: str) -> List[float]:
    """Per-token log-ratios (trainer - rollout; = beta when synchronous) from the run's token dumps."""
    out: List[float] = []
    for path in sorted(glob.glob(os.path.join(run_dir, "tokens_step*.json"))):
        dump = json.load(open(path))
        out += [a - b for a, b in zip(dump["log_probs"], dump["old_log_probs"])]
    if not out:
        raise SystemExit(f"eps choice: {run_dir} has no tokens_step*.json (see its train.log)")
    return out


def choose_eps(log_ratios: Sequence[float]) -> Dict[str, float]:
    """The main eps and the dose eps from the scout's sample, with what they predict."""
    sd = statistics.pstdev(log_ratios)
    out = {"n_tokens": len(log_ratios), "beta_std": sd, "beta_abs_mean": statistics.mean(abs(x) for x in log_ratios),
           "scout_fraction": fraction_outside(log_ratios, SCOUT_EPS), "eps": eps_for_fraction(log_ratios, TARGET_PHANTOM)}
    for run, target in DOSE_TARGETS.items():
        out[f"eps_{run}"] = eps_for_fraction(log_ratios, target)
    return out


# ----------------------------------------------------------------------------- gates

def _step(rows: List[dict], key: str, step: int) -> Optional[float]:
    return next((r.get(key) for r in rows if r.get("step") == step), None)


def gates(a_rows: List[dict], b_rows: List[dict]) -> List[Tuple[str, bool, str]]:
    """(gate, passed, measured) for the probes; a metric not logged fails its gate."""
    out = []
    alpha, region = _step(a_rows, "precision/alpha_abs_mean", 1), _step(a_rows, "clip/region_fraction", 1)
    out.append(("A: alpha_abs_mean == 0 and clip/region_fraction == 0 at step 1", alpha == 0.0 and region == 0.0,
                f"alpha_abs_mean {alpha}, region_fraction {region}"))
    steps = range(1, PROBE_STEPS + 1)
    snr = [_step(b_rows, "precision/snr", s) for s in steps]
    out.append((f"B: precision/snr < {SNR_MAX:g} at steps 1-{PROBE_STEPS}",
                all(v is not None and v < SNR_MAX for v in snr), f"snr {snr}"))
    phantom = [_step(b_rows, "clip/phantom_region_fraction", s) for s in steps]
    legit = [_step(b_rows, "clip/legit_region_fraction", s) for s in steps]
    ok = None not in phantom and PHANTOM_GATE[0] <= statistics.mean(phantom) <= PHANTOM_GATE[1]
    out.append((f"B: clip/phantom_region_fraction in [{PHANTOM_GATE[0]:g}, {PHANTOM_GATE[1]:g}] (mean of steps "
                f"1-{PROBE_STEPS})", ok, f"phantom {_fmt_list(phantom)}"))
    out.append((f"B: clip/legit_region_fraction <= {LEGIT_MAX:g} at steps 1-{PROBE_STEPS}",
                None not in legit and max(legit) <= LEGIT_MAX, f"legit {_fmt_list(legit)}"))
    return out


def _fmt_list(xs) -> str:
    return "[" + ", ".join("n/a" if x is None else f"{x:.4g}" for x in xs) + "]"


# ----------------------------------------------------------------------------- the decision rule

def decide(diffs: Sequence[float], d: float = EQUIV_D, min_effect: float = EQUIV_D) -> Tuple[str, float, float, int]:
    """The pre-registered rule (``experiments.decide``) with this study's equivalence margin ``EQUIV_D``."""
    return experiments.decide(diffs, d, min_effect)


def h1_verdict(a: List[Dict], b: List[Dict]) -> Tuple[str, str]:
    """(word, sentence) for H1 from per-seed stats of A and B (``final_reward``, ``gain``, ``seed``)."""
    word, mean, half, n = decide(paired_diffs(a, b))
    gain = ci95([s["gain"] for s in a])[0]
    if not gain >= MIN_A_GAIN:  # A did not learn (or no A): nothing for B to fail at (nan fails too)
        word = "inconclusive"
    why = (f"final-{FINAL_LAST} reward A - B = {mean:.3g} ± {half:.2g} (95% t, {n} paired seeds); d = {EQUIV_D:g}; "
           f"A's gain (final-{FINAL_LAST} minus steps 1-5) {gain:.3g} (validity needs >= {MIN_A_GAIN:g})")
    return word, why


def h2_verdict(f: List[Dict], lo: List[Dict], hi: List[Dict]) -> Tuple[str, str]:
    """H2: F - B at the 2x dose decided by :func:`decide`; 'reproduced' also needs gap(2x) > gap(1x) in the mean."""
    word, mean, half, n = decide(paired_diffs(f, hi))
    gap_lo = ci95(paired_diffs(f, lo))[0]
    if word == "reproduced" and not mean > gap_lo:
        word = "inconclusive"
    return word, (f"final-{FINAL_LAST} reward F - B(2x) = {mean:.3g} ± {half:.2g} ({n} paired seeds), "
                  f"F - B(1x) = {gap_lo:.3g}; d = {EQUIV_D:g}")


# ----------------------------------------------------------------------------- reading the runs

def stage_stats(out: str, stage: str) -> Dict[str, List[Dict]]:
    """``{run: [per-seed stats]}`` of a stage's COMPLETE runs (partial runs are left out)."""
    runs, seeds, steps = STAGES[stage]
    table = {}
    for run in runs:
        per = []
        for s in seeds:
            rows = read_rows(os.path.join(out, stage, run, f"seed{s}"))
            if len(rows) >= steps:
                st = experiments.seed_stats(rows, THRESHOLD, FINAL_LAST)
                st["gain"] = st["final_reward"] - experiments.mean_key(rows, "reward/mean", 1, 5)
                st["phantom_zero_grad"] = experiments.mean_key(rows, "clip/phantom_zero_grad_fraction")
                st["phantom_region"] = experiments.mean_key(rows, "clip/phantom_region_fraction")
                st["cos_series"] = [r["grad/cos_clean"] for r in rows if r.get("grad/cos_clean") is not None]
                st["beta_common"] = experiments.mean_key(rows, "precision/beta_abs_mean_common")
                st["beta_nonzero_rare"] = experiments.mean_key(
                    [r for r in rows if r.get("precision/beta_abs_mean_rare")], "precision/beta_abs_mean_rare")
                per.append(dict(st, seed=s))
        table[run] = per
    return table


def estimate_wall(out: str) -> Dict[str, float]:
    """Seconds per stage, from the gate probes: steps x mean step time + each run's start-up (the process's
    launch-to-exit time, ``process.json`` of ``experiments.run_one``, else the trainer's ``summary.json`` wall, minus the steps)."""
    per_run = {}
    for probe, variant in (("probe-A", "A"), ("probe-B", "B")):
        d = os.path.join(out, "gates", probe, "seed0")
        rows = read_rows(d)
        steps = [r["time/step_s"] for r in rows if r.get("time/step_s") is not None]
        walls = [json.load(open(p)).get(k, 0.0) for p, k in ((os.path.join(d, "process.json"), "process_wall_s"),
                                                               (os.path.join(d, "summary.json"), "wall_s"))
                 if os.path.isfile(p)]
        if not steps or not walls:
            return {}
        start = max(0.0, walls[0] - sum(steps))
        per_run[variant] = (statistics.mean(steps), start)
    est = {}
    for stage in ("main", "dose"):
        runs, seeds, n = STAGES[stage]
        est[stage] = sum(len(seeds) * (n * per_run["A" if r == "A" else "B"][0] + per_run["A" if r == "A" else "B"][1])
                         for r in runs)
    est["step_s_A"], est["step_s_B"] = per_run["A"][0], per_run["B"][0]
    return est


def measured_wall(out: str) -> Dict[str, float]:
    """Seconds per stage actually spent: the sum of its runs' launch-to-exit times (their process.json)."""
    return {stage: sum(json.load(open(p)).get("process_wall_s", 0.0)
                       for p in glob.glob(os.path.join(out, stage, "*", "seed*", "process.json")))
            for stage in STAGES}


def export_metrics(out: str, dest: str) -> List[str]:
    """Copies every run's metrics.jsonl, summary.json and the scout's token dumps to ``dest`` (same layout)."""
    copied = []
    for stage in STAGES:
        for path in sorted(glob.glob(os.path.join(out, stage, "*", "seed*", "*"))):
            name = os.path.basename(path)
            if name in ("metrics.jsonl", "summary.json", "process.json") or (stage == "probe" and name.startswith("tokens_step")):
                target = os.path.join(dest, os.path.relpath(path, out))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(path, target)
                copied.append(target)
    return copied


# ----------------------------------------------------------------------------- the page

def load_state(out: str) -> Dict:
    return experiments.load_state(os.path.join(out, "regime.json"))


def save_state(out: str, **update) -> Dict:
    return experiments.save_state(os.path.join(out, "regime.json"), **update)


def _eps_section(state: Dict) -> List[str]:
    c = state.get("eps_choice")
    if not c:
        return ["(the scout has not run yet)"]
    return [f"Scout ({PROBE_STEPS} steps of B at eps {SCOUT_EPS:g}, seed 0, per-token dumps): {c['n_tokens']} tokens, "
            f"std(beta) {c['beta_std']:.4g}, mean |beta| {c['beta_abs_mean']:.4g}, share outside [1-eps, 1+eps] at the "
            f"scout eps {c['scout_fraction']:.3g}. Chosen: main eps **{c['eps']:.4g}** (predicted share outside "
            f"{TARGET_PHANTOM:g}); dose eps " + ", ".join(f"{r} {c['eps_' + r]:.4g} ({t:g})" for r, t in
                                                         DOSE_TARGETS.items()) + "."]


def _gate_section(state: Dict) -> List[str]:
    g = state.get("gates")
    if not g:
        return ["(the gate probes have not run yet)"]
    rows = [[name, "pass" if ok else "**FAIL**", measured] for name, ok, measured in g]
    lines = md_table(["gate", "result", "measured"], rows)
    if not all(ok for _, ok, _ in g):
        lines += ["", "**A gate failed: the main and dose stages do not count**" +
                  (" (they were run flagged: `--run-flagged`)." if state.get("flagged") else " (not run).")]
    est = state.get("estimate")
    if est:
        lines += ["", f"Step time in the probes: A {est['step_s_A']:.1f} s, B {est['step_s_B']:.1f} s (shared, niced CPU). "
                  f"Estimated wall: main {est['main'] / 3600:.1f} h, dose {est['dose'] / 3600:.1f} h (steps x probe step "
                  "time + each run's start-up; later steps are shorter as completions shorten)."]
    return lines


def _wall_line(out: str) -> str:
    wall = measured_wall(out)
    return ("Measured wall (sum of the runs' launch-to-exit times so far): " +
            ", ".join(f"{stage} {wall[stage] / 60:.1f} min" for stage in STAGES) + ".")


def _stage_table(stats: Dict[str, List[Dict]], stage: str) -> List[str]:
    runs, seeds, steps = STAGES[stage]
    rows = [[r, f"{len(stats[r])}/{len(seeds)}", fmt_ci([s["reward_step1"] for s in stats[r]]),
             fmt_ci([s["final_reward"] for s in stats[r]]), fmt_ci([s["gain"] for s in stats[r]]),
             fmt_ci([s["deployed_improvement"] for s in stats[r]]), fmt_ci([s["phantom_region"] for s in stats[r]]),
             fmt_ci([s["phantom_zero_grad"] for s in stats[r]]), fmt_ci([s["cos_clean"] for s in stats[r]])]
            for r in runs]
    return md_table(["run", "complete seeds", "reward step 1", f"final-{FINAL_LAST} reward", "gain",
                              "deployed improvement / step", "phantom region (mean)", "phantom zero-grad (mean)",
                              "grad cosine with clean"], rows)


def _seed_rows(stats: Dict[str, List[Dict]], x: str, y: str) -> List[str]:
    ys = {s["seed"]: s["final_reward"] for s in stats[y]}
    rows = [[str(s["seed"]), f"{s['final_reward']:.4g}", f"{ys[s['seed']]:.4g}", f"{s['final_reward'] - ys[s['seed']]:.4g}"]
            for s in stats[x] if s["seed"] in ys]
    return md_table(["seed", x, y, f"{x} - {y}"], rows)


def _verdict_lines(main: Dict[str, List[Dict]], dose: Dict[str, List[Dict]], counted: bool) -> List[str]:
    tag = "" if counted else " (gates failed or not run: this does not count)"
    lines = []
    if len(main["A"]) == len(MAIN_SEEDS) and len(main["B"]) == len(MAIN_SEEDS):
        word, why = h1_verdict(main["A"], main["B"])
        dep = experiments.compare(main["A"], main["B"], "deployed_improvement")
        lines += [f"- **H1 (B ends worse than A): {word}**{tag}: {why}.",
                  f"- Secondary: deployed improvement / step A vs B: {dep} (the write-up: A 5.5x B)."]
    else:
        lines.append(f"- H1: pending ({len(main['A'])}/{len(MAIN_SEEDS)} A and {len(main['B'])}/{len(MAIN_SEEDS)} B "
                     "runs complete): no verdict before every pre-registered run is in.")
    if all(len(dose[r]) == len(DOSE_SEEDS) for r in STAGES["dose"][0]):
        word, why = h2_verdict(dose["F"], dose["B-dose15"], dose["B-dose30"])
        lines.append(f"- **H2 (the gap grows with the phantom dose): {word}**{tag}: {why}.")
    else:
        lines.append("- H2: pending (" + ", ".join(f"{r} {len(dose[r])}/{len(DOSE_SEEDS)}" for r in dose) + " complete).")
    return lines


def headline(state: Dict, main: Dict[str, List[Dict]], dose: Dict[str, List[Dict]]) -> str:
    """One line, worded by the pre-registered rule only."""
    if not state.get("gates"):
        return "**Headline**: no result yet: the probe stage has not run."
    failed = [name for name, ok, _ in state["gates"] if not ok]
    if failed:
        return f"**Headline**: gate(s) failed ({'; '.join(failed)}): the regime is not the write-up's; no main result counts."
    n_main = sum(len(v) for v in main.values())
    if n_main < 2 * len(MAIN_SEEDS):
        return f"**Headline**: gates passed; H1 pending ({n_main}/{2 * len(MAIN_SEEDS)} main runs complete)."
    h1 = h1_verdict(main["A"], main["B"])[0]
    h2 = (h2_verdict(dose["F"], dose["B-dose15"], dose["B-dose30"])[0]
          if all(len(dose[r]) == len(DOSE_SEEDS) for r in dose) else "pending")
    return f"**Headline**: {scope_line(main)}; by the pre-registered rule the write-up's failure is **{h1}** (H1); " \
           f"dose-response H2: **{h2}**."


WRITEUP_ZERO_GRAD = 0.125
"""The write-up's zero-gradient dose at step 3: TRL's ``clip_ratio/region_mean`` 13.5% (B) vs 1.0% (A), a token
counted only when clipped in its advantage's direction: ~12.5 percentage points."""


def scope_line(main: Dict[str, List[Dict]]) -> str:
    """What the runs tested, from their metrics: synchronous, the zero-gradient dose against the write-up's,
    rarity coupling of beta, and how far B trailed A (seeds, share of A's gain)."""
    a, b = {s["seed"]: s for s in main["A"]}, {s["seed"]: s for s in main["B"]}
    seeds = sorted(set(a) & set(b))
    trailed = sum(a[k]["final_reward"] > b[k]["final_reward"] for k in seeds)
    gap = statistics.mean(a[k]["final_reward"] - b[k]["final_reward"] for k in seeds)
    gain = statistics.mean(a[k]["gain"] for k in seeds)
    dose = statistics.mean(s["phantom_zero_grad"] for s in main["B"])
    rare = [s["beta_nonzero_rare"] for s in main["B"] if not math.isnan(s["beta_nonzero_rare"])]
    coupling = (f"rare-token beta {statistics.mean(rare) / statistics.mean(s['beta_common'] for s in main['B']):.1f}x "
                "the common tokens'") if rare else "no rare tokens (log-prob < -20) sampled, so no rarity coupling"
    return (f"synchronous runs (generation.max_staleness=0: alpha = 0, every clip in B is phantom), B zeroing "
            f"{dose:.1%} of its tokens' gradients (~{dose / WRITEUP_ZERO_GRAD:.2f}x the write-up's "
            f"{WRITEUP_ZERO_GRAD:.1%}), {coupling}: B trailed A in {trailed}/{len(seeds)} seeds by "
            f"{gap / gain:.0%} of A's gain ({gap:.2f} of {gain:.2f})")


def _cos_medians(stats: Dict[str, List[Dict]]) -> str:
    """Medians of the gradient cosine with the clean gradient over every logged step (the means are pulled down
    by steps where every group had advantage 0: cosine 0 or negative)."""
    parts = [f"{r} {statistics.median(sum((s['cos_series'] for s in per), [])):.3g}"
             for r, per in stats.items() if any(s["cos_series"] for s in per)]
    return "Gradient cosine with the clean gradient, median over every logged step: " + ", ".join(parts) + \
        " (the means above are pulled down by steps where every group had advantage 0)."


def write_page(out: str, doc: Optional[str] = None) -> str:
    """Writes ``doc`` (default ``OUT/writeup-regime.md``) from ``OUT/regime.json`` and the runs' metrics."""
    state, doc = load_state(out), doc or os.path.join(out, "writeup-regime.md")
    main, dose = stage_stats(out, "main"), stage_stats(out, "dose")
    passed = bool(state.get("gates")) and all(ok for _, ok, _ in state["gates"])
    lines = ["# The write-up's failure in the write-up's regime (issue 26; generated)", "",
             f"Pre-registration: [{os.path.basename(PREREG)}]({os.path.basename(PREREG)}) (criteria, runs and gates "
             f"fixed before the main runs). Command: `python tools/study/sweep.py --grid writeup-regime --out "
             f"{os.path.relpath(out, ROOT)}`; recipe `{RECIPE}` with `{' '.join(_BASE)}`; every number "
             "is read from the runs' metrics.jsonl (raw files: `writeup-regime/`) by tools/study/writeup_regime.py.", "",
             headline(state, main, dose), "", "## The model", ""] + experiments.model_card_lines(os.path.join(ROOT, experiments.WRITEUP_MODEL_DIR)) + [
             "", "## Probe stage: eps and gates", ""] + _eps_section(state) + [""] + _gate_section(state)
    lines += ["", _wall_line(out)]
    lines += ["", f"## Main: A vs B ({len(MAIN_SEEDS)} seeds x {MAIN_STEPS} steps)", ""] + _stage_table(main, "main")
    lines += ["", _cos_medians(main), ""] + _seed_rows(main, "A", "B")
    lines += ["", f"## Dose-response: F, B at 1x and 2x dose ({len(DOSE_SEEDS)} seeds x {DOSE_STEPS} steps)", ""]
    lines += _stage_table(dose, "dose") + ["", _cos_medians(dose), ""] + _seed_rows(dose, "F", "B-dose30")
    lines += ["", "## Verdicts (worded by the pre-registered rule)", ""] + _verdict_lines(main, dose, passed) + [""]
    with open(doc, "w") as f:
        f.write("\n".join(lines))
    return doc


# ----------------------------------------------------------------------------- the sweep


def run_stages(args) -> int:
    """Scout -> eps -> gate probes -> main -> dose, the page after each; a failed gate stops before the main
    stage unless ``--run-flagged``."""
    out = args.out
    run = lambda stage, pairs, steps, pre=(): args.summary_only or experiments.run_pairs(  # noqa: E731
        RECIPE, RUNS, os.path.join(out, stage), pairs, steps, args.nproc, args.overrides, pre, cwd=ROOT)
    experiments.ensure_pretrained_model(ROOT)
    os.makedirs(out, exist_ok=True)
    ok = run("probe", [("scout-B", 0)], PROBE_STEPS)
    choice = choose_eps(load_log_ratios(os.path.join(out, "probe", "scout-B", "seed0")))
    print(f"[sweep] main eps {choice['eps']:.4g}, dose eps "
          + ", ".join(f"{r} {choice['eps_' + r]:.4g}" for r in DOSE_TARGETS), flush=True)
    ok &= run("gates", [("probe-A", 0), ("probe-B", 0)], PROBE_STEPS, eps_overrides(choice["eps"]))
    probes = gates(read_rows(os.path.join(out, "gates", "probe-A", "seed0")),
                   read_rows(os.path.join(out, "gates", "probe-B", "seed0")))
    passed = all(g[1] for g in probes)
    save_state(out, eps_choice=choice, gates=probes, estimate=estimate_wall(out),
               flagged=not passed and args.run_flagged)
    for name, good, measured in probes:
        print(f"[sweep] gate {'pass' if good else 'FAIL'}: {name}: {measured}", flush=True)
    write_page(out)
    if args.stage == "probe" or not (passed or args.run_flagged):
        print(f"[sweep] wrote {os.path.join(out, 'writeup-regime.md')}" + ("" if passed else " (gates failed)"))
        return 0 if ok and passed else 1
    for stage in ("main", "dose"):
        runs, seeds, steps = STAGES[stage]
        for seed in seeds:  # seed-major: a partial stage still has complete pairs
            for name in runs:
                ok &= run(stage, [(name, seed)], steps, eps_overrides(choice.get(f"eps_{name}", choice["eps"])))
                write_page(out)
    print(f"[sweep] wrote {write_page(out)}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="sweep folder (stage/run/seedK/metrics.jsonl, regime.json, page)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun)")
    parser.add_argument("--summary-only", action="store_true", help="no runs: the page from the metrics there")
    parser.add_argument("--stage", choices=("probe", "all"), default="all",
                        help="stop after the probe stage, or go on to main + dose if the gates pass")
    parser.add_argument("--run-flagged", action="store_true",
                        help="run main + dose even if a gate fails (the page flags them)")
    parser.add_argument("--page", default=None, metavar="DOC", help="only rewrite the page to DOC from OUT")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="with --page: copy every run's raw metrics.jsonl / summary.json to DIR")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.page:
        if args.export:
            print(f"{len(export_metrics(args.out, args.export))} files -> {args.export}")
        print(write_page(args.out, doc=args.page))
        return 0
    return run_stages(args)


if __name__ == "__main__":
    sys.exit(main())
