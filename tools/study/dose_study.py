"""Issue 34 item 5: the mechanism at the write-up's dose, pre-registered (docs/results/preregistration-dose.md).

``python tools/study/dose_study.py --out runs/dose`` runs, in order (each run resumable; the constants below are the
ones the pre-registration states, checked by tests/test_dose_study.py):

1. ``scout``: B at k = 1 (``loss_fn.ratio=gap_scaled``, the trainer's real gap), :data:`PROBE_STEPS` steps,
   seed 0, per-token dumps. From its tokens: k = :data:`TARGET_GAP` / mean |beta| (the write-up's mean |beta|
   on our model's token distribution) and the rarity-shaped k_t of B-rare (:func:`rare_scales`, SmolLM2's
   measured profile from ``--profile``, ``tools/study/beta_real.py``'s CSV);
2. ``gates``: B, B2 and B-rare for :data:`PROBE_STEPS` steps, seed 0, checked by :func:`gates`;
3. ``main``: every arm of :data:`ARMS`, :data:`SEEDS` x :data:`STEPS` steps, in :data:`BLOCKS` (the primary
   arms first, seed-major within a block), whatever the gates said (an arm whose gate failed is flagged on the page);
4. writes ``OUT/dose.md`` after every run (``--page DOC`` rewrites it anywhere, ``--export DIR`` copies every
   run's raw metrics.jsonl), verdicts by :func:`verdicts`.

Every run: the locally pretrained Qwen3 (``recipes/grpo-pretrained-eos-cpu.yaml``), ``generation.backend=megatron``
(exact alpha, no vLLM kernel residual), one step of asynchronous lag (``generation.max_staleness=1``: alpha != 0
from step 2, as the write-up's trainer), fp32 trainer and bf16 generator, eps 0.2 unscaled, lr :data:`LR`.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import shutil
import statistics
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from writeup_regime import decide  # noqa: E402  (tools/ sibling: the same decision rule as issue 26's)

from megatron_grpo.observe import experiments  # noqa: E402
from megatron_grpo.observe.experiments import ci95, fmt_ci, md_table, paired_diffs, read_rows  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
RECIPE = experiments.WRITEUP_RECIPE
PREREG = "docs/results/preregistration-dose.md"
LR = 1e-4
"""The lr of issue 26's study (A learned within its 70 steps there)."""
EPS = 0.2
TARGET_GAP = 0.07
"""mean |k beta| of B: the write-up's mean |beta| 0.076, rounded as the issue states."""
PROBE_STEPS, STEPS, SEEDS = 3, 100, (0, 1, 2)
FIRST_STEPS = 30
"""Deployed improvement per step is compared over steps 1..FIRST_STEPS (the write-up: B ~1/5.5 of A)."""
FINAL_LAST = 10
EQUIV_D = 1.5
"""Equivalence bound and minimum effect (reward units = tokens of completion length), as issue 26."""
MIN_G_GAIN = 3.0
"""Validity: G's final-10 reward minus its steps 1-5 mean must reach 2 d, else there is no learning to spoil."""
DI_REPRODUCED, DI_NOT = 0.5, 0.8
"""H2: B / G deployed improvement <= 0.5 (with G - B's interval above 0) reproduces; >= 0.8 does not."""
SNR_MAX, PHANTOM_ZERO_MIN, LEGIT_MAX = 1.0, 0.10, 0.02
"""Gates on steps 1-3 of each probe: precision/snr_in_ratio < 1 (steps 2-3; step 1 has alpha = 0), mean
clip/phantom_zero_grad_fraction >= 10%, clip/legit_region_fraction <= 2% at every step."""
SMOLLM2_PAIR = "megatron fp32 vs vLLM bf16 (run B's pair)"
"""The row of ``tools/study/beta_real.py``'s CSV whose rarity profile B-rare copies (SmolLM2's real generator pair)."""
BUCKETS = (("gt-5", -5.0, math.inf), ("-10..-5", -10.0, -5.0), ("-20..-10", -20.0, -10.0), ("le-20", -math.inf, -20.0))
MIN_BUCKET_TOKENS = 10
"""A SmolLM2 bucket with fewer tokens takes the profile value of its neighbour on the common side."""

_BASE = ["generation.backend=megatron", "generation.max_staleness=1", f"policy.megatron_cfg.optimizer.lr={LR:g}",
         "policy.precision.compute_dtype=float32", "policy.precision.generation_dtype=bfloat16",
         f"loss_fn.ratio_clip_min={EPS:g}", f"loss_fn.ratio_clip_max={EPS:g}"]
ARMS = ("G", "B", "F", "B2", "noclip", "Brare")
BLOCKS = (("G", "B", "F"), ("B2", "noclip", "Brare"))
"""Run order of the main stage: the arms of H1, H2 and H3a first, seed-major within each block, so that a
budget cut leaves complete seeds of the primary comparison."""


def arm_overrides(arm: str, k: float, rare: Optional[List[List[float]]] = None, k_common: float = 1.0) -> List[str]:
    """The overrides of one arm at calibrated scale ``k`` (B-rare: ``rare`` pairs and ``k_common``)."""
    scaled = lambda s: ["loss_fn.ratio=gap_scaled", f"loss_fn.gap_scale={s:.6g}"]  # noqa: E731
    table = {"G": scaled(0.0), "B": scaled(k), "B2": scaled(2 * k), "F": ["loss_fn.ratio=one"],
             "noclip": scaled(k) + ["loss_fn.ratio_clip_min=10", "loss_fn.ratio_clip_max=10"],
             "scout": scaled(1.0) + [f"logger.token_dump_steps=[{','.join(map(str, range(1, PROBE_STEPS + 1)))}]"]}
    if arm == "Brare":
        pairs = ",".join(f"[{lp:g},{v:.6g}]" for lp, v in (rare or []))
        return scaled(k_common) + [f"loss_fn.gap_scale_by_logprob=[{pairs}]"]
    return table[arm]


# ----------------------------------------------------------------------------- calibration

def scout_tokens(run_dir: str) -> List[Tuple[float, float]]:
    """(beta, generator log-prob) per token of the scout's dumps (beta = trainer - shadow)."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "tokens_step*.json"))):
        d = json.load(open(path))
        out += [(lp - sh, old) for lp, sh, old in zip(d["log_probs"], d["shadow_log_probs"], d["old_log_probs"])]
    if not out:
        raise SystemExit(f"calibration: {run_dir} has no tokens_step*.json (see its train.log)")
    return out


def bucket_of(lp: float) -> str:
    return next(name for name, low, high in BUCKETS if low < lp <= high)


def smollm2_profile(csv_path: str) -> Dict[str, float]:
    """SmolLM2's mean |beta| per bucket relative to its common bucket; thin buckets copy the next common one."""
    row = next((r for r in csv.DictReader(open(csv_path)) if r["pair"] == SMOLLM2_PAIR), None)
    if row is None:
        raise SystemExit(f"{csv_path}: no row {SMOLLM2_PAIR!r} (run tools/study/beta_real.py with the vLLM generator)")
    prof, last = {}, None
    for name, _, _ in BUCKETS:
        ok = int(row[f"n_{name}"]) >= MIN_BUCKET_TOKENS and row[f"beta_abs_{name}"] not in ("", "nan")
        last = float(row[f"beta_abs_{name}"]) if ok else last
        prof[name] = last
    return {name: v / prof["gt-5"] for name, v in prof.items()}


def rare_scales(tokens: List[Tuple[float, float]], profile: Dict[str, float]) -> Tuple[float, List[List[float]]]:
    """B-rare's k per bucket: |k_b beta| follows SmolLM2's profile (relative to the common bucket) on our tokens,
    scaled so that mean |k_t beta| over the scout's tokens is TARGET_GAP. Returns (k_common, [[lp_max, k], ...])."""
    by = {name: [abs(b) for b, lp in tokens if bucket_of(lp) == name] for name, _, _ in BUCKETS}
    ours = {name: statistics.mean(v) if v else None for name, v in by.items()}
    base = ours["gt-5"] or statistics.mean(abs(b) for b, _ in tokens)
    shape = {name: profile[name] * base / (ours[name] or base) for name in by}  # k_b up to one factor
    total = sum(shape[name] * sum(v) for name, v in by.items()) / len(tokens)
    c = TARGET_GAP / total
    rare = [[high, c * shape[name]] for name, _, high in reversed(BUCKETS) if high != math.inf]
    return c * shape["gt-5"], rare


def calibrate(scout_dir: str, profile_csv: str) -> Dict:
    tokens = scout_tokens(scout_dir)
    mean_abs = statistics.mean(abs(b) for b, _ in tokens)
    k_common, rare = rare_scales(tokens, smollm2_profile(profile_csv))
    return dict(n_tokens=len(tokens), beta_abs_mean=mean_abs, k=TARGET_GAP / mean_abs, k_common=k_common, rare=rare,
                by_bucket={name: [sum(1 for _, lp in tokens if bucket_of(lp) == name)] for name, _, _ in BUCKETS})


# ----------------------------------------------------------------------------- gates

def _at(rows: List[dict], key: str, step: int) -> Optional[float]:
    return next((r.get(key) for r in rows if r.get("step") == step), None)


def gates(rows: List[dict]) -> List[Tuple[str, bool, str]]:
    """(gate, passed, measured) for one probe's steps 1-3; a metric not logged fails its gate."""
    steps = range(1, PROBE_STEPS + 1)
    snr = [_at(rows, "precision/snr_in_ratio", s) for s in steps[1:]]
    phantom = [_at(rows, "clip/phantom_zero_grad_fraction", s) for s in steps]
    legit = [_at(rows, "clip/legit_region_fraction", s) for s in steps]
    fmt = lambda xs: "[" + ", ".join("n/a" if x is None else f"{x:.3g}" for x in xs) + "]"  # noqa: E731
    return [(f"snr_in_ratio < {SNR_MAX:g} at steps 2-{PROBE_STEPS}", None not in snr and max(snr) < SNR_MAX,
             f"snr {fmt(snr)}"),
            (f"phantom zero-grad >= {PHANTOM_ZERO_MIN:g} (mean of steps 1-{PROBE_STEPS})",
             None not in phantom and statistics.mean(phantom) >= PHANTOM_ZERO_MIN, f"phantom zero-grad {fmt(phantom)}"),
            (f"legit region <= {LEGIT_MAX:g} at steps 1-{PROBE_STEPS}", None not in legit and max(legit) <= LEGIT_MAX,
             f"legit {fmt(legit)}")]


# ----------------------------------------------------------------------------- reading and deciding

def arm_stats(out: str, arm: str) -> List[Dict]:
    """Per-seed numbers of an arm's COMPLETE runs (partial runs are left out)."""
    per = []
    for seed in SEEDS:
        rows = read_rows(os.path.join(out, "main", arm, f"seed{seed}"))
        if len(rows) < STEPS:
            continue
        st = experiments.seed_stats(rows, -4.0, FINAL_LAST)
        st.update(seed=seed, gain=st["final_reward"] - experiments.mean_key(rows, "reward/mean", 1, 5),
                  di_first=experiments.mean_key(rows, "policy/deployed_improvement", 1, FIRST_STEPS),
                  phantom_zero=experiments.mean_key(rows, "clip/phantom_zero_grad_fraction", 1, FIRST_STEPS),
                  legit_region=experiments.mean_key(rows, "clip/legit_region_fraction", 1, FIRST_STEPS),
                  gap=experiments.mean_key(rows, "precision/gap_in_ratio_abs_mean", 1, FIRST_STEPS),
                  cos_series=[r["grad/cos_clean"] for r in rows if r.get("grad/cos_clean") is not None])
        per.append(st)
    return per


def di_verdict(g: List[Dict], b: List[Dict]) -> Tuple[str, str]:
    """H2 on deployed improvement per step over steps 1..FIRST_STEPS, paired by seed."""
    mean, half, n = ci95(paired_diffs(g, b, "di_first"))
    gm, bm = ci95([s["di_first"] for s in g])[0], ci95([s["di_first"] for s in b])[0]
    ratio = bm / gm if gm and not math.isnan(gm) else float("nan")
    word = "inconclusive"
    if n >= 2 and not math.isnan(half) and gm > 0:
        if mean - half > 0 and ratio <= DI_REPRODUCED:
            word = "reproduced"
        elif ratio >= DI_NOT or mean + half < 0:
            word = "not reproduced"
    return word, (f"deployed improvement / step, steps 1-{FIRST_STEPS}: B / G = {ratio:.3g} (G {gm:.3g}, B {bm:.3g}); "
                  f"G - B = {mean:.3g} ± {half:.2g} ({n} paired seeds); the write-up: ~1/5.5 = 0.18")


def verdicts(stats: Dict[str, List[Dict]], gate_ok: Dict[str, bool]) -> List[Tuple[str, str, str]]:
    """(hypothesis, word, why) by the pre-registered rules; an arm whose gate failed is flagged in the word."""
    g_gain = ci95([s["gain"] for s in stats.get("G", [])])[0]
    valid = g_gain >= MIN_G_GAIN
    out = []
    for hyp, x, y in (("H1: G - B (final reward)", "G", "B"), ("H1b: G - B2", "G", "B2"),
                      ("H1c: G - B-rare", "G", "Brare"), ("H3a: F - B", "F", "B"), ("H3b: noclip - B", "noclip", "B")):
        word, mean, half, n = decide(paired_diffs(stats.get(x, []), stats.get(y, [])), EQUIV_D, EQUIV_D)
        word = word if valid else "inconclusive"
        flag = "" if gate_ok.get(y, True) else " (flagged: the arm's gate failed)"
        out.append((hyp, word + flag, f"final-{FINAL_LAST} reward {x} - {y} = {mean:.3g} ± {half:.2g} ({n} paired "
                                      f"seeds); d = {EQUIV_D:g}"))
    word, why = di_verdict(stats.get("G", []), stats.get("B", []))
    out.append(("H2: deployed improvement B / G", word if valid else "inconclusive", why))
    out.append(("validity: G learned", "yes" if valid else "no",
                f"G's gain (final-{FINAL_LAST} minus steps 1-5) {g_gain:.3g}; needs >= {MIN_G_GAIN:g}"))
    return out


# ----------------------------------------------------------------------------- the page

def load_state(out: str) -> Dict:
    return experiments.load_state(os.path.join(out, "dose.json"))


def save_state(out: str, **update) -> Dict:
    return experiments.save_state(os.path.join(out, "dose.json"), **update)


def _calibration_lines(state: Dict) -> List[str]:
    c = state.get("calibration")
    if not c:
        return ["(the scout has not run yet)"]
    rare = ", ".join(f"lp <= {lp:g}: k {k:.3g}" for lp, k in c["rare"])
    return [f"Scout (B at k = 1, {PROBE_STEPS} steps, seed 0): {c['n_tokens']} tokens, our real mean |beta| "
            f"**{c['beta_abs_mean']:.4g}** -> k = {TARGET_GAP:g} / that = **{c['k']:.3g}** (B2: {2 * c['k']:.3g}). "
            f"B-rare (SmolLM2's profile, mean |k_t beta| = {TARGET_GAP:g} on the scout's tokens): k {c['k_common']:.3g} "
            f"above lp -5, {rare}. Scout tokens per bucket: " +
            ", ".join(f"{b} {n[0]}" for b, n in c["by_bucket"].items()) + "."]


def _arm_table(stats: Dict[str, List[Dict]]) -> List[str]:
    head = ["arm", "seeds", f"final-{FINAL_LAST} reward", "gain", f"deployed impr. / step 1-{FIRST_STEPS}",
            f"mean abs k beta 1-{FIRST_STEPS}", f"phantom zero-grad 1-{FIRST_STEPS}", f"legit region 1-{FIRST_STEPS}",
            "grad cos clean (median)"]
    rows = []
    for arm, per in stats.items():
        cos = sum((s["cos_series"] for s in per), [])
        rows.append([arm, str(len(per))] + [fmt_ci([s[k] for s in per]) for k in
                                            ("final_reward", "gain", "di_first", "gap", "phantom_zero", "legit_region")]
                    + [f"{statistics.median(cos):.3g}" if cos else "n/a"])
    return md_table(head, rows)


def headline(out: str, stats: Dict[str, List[Dict]], gate_ok: Dict[str, bool]) -> str:
    """One sentence worded by the rules: whether the write-up's dose was reached, then H1 and H2's words."""
    words = {h.split(":")[0]: w for h, w, _ in verdicts(stats, gate_ok)}
    reached = [arm for arm, ok in gate_ok.items() if ok]
    zero = {arm: experiments.mean_key(read_rows(os.path.join(out, "gates", arm, "seed0")),
                                      "clip/phantom_zero_grad_fraction", 1, PROBE_STEPS) for arm in gate_ok}
    dose = ", ".join(f"{arm} {v:.1%}" for arm, v in zero.items())
    where = (f"the gates passed for {', '.join(reached)}" if reached else
             f"no arm reached the write-up's dose (phantom zero-grad at steps 1-3: {dose}; the gate asks >= "
             f"{PHANTOM_ZERO_MIN:.0%}), so every comparison is flagged as outside the write-up's regime")
    return (f"**Headline** (worded by the pre-registered rules): {where}. H1 (G - B final reward): {words['H1']}; "
            f"H2 (deployed improvement B / G): {words['H2']}; complete runs: "
            f"{sum(len(v) for v in stats.values())} of {len(ARMS) * len(SEEDS)}.")


def write_page(out: str, doc: Optional[str] = None) -> str:
    """Writes ``doc`` (default ``OUT/dose.md``) from ``OUT/dose.json`` and the runs' metrics."""
    state, doc = load_state(out), doc or os.path.join(out, "dose.md")
    stats = {arm: arm_stats(out, arm) for arm in ARMS}
    gate_ok = {arm: all(ok for _, ok, _ in g) for arm, g in state.get("gates", {}).items()}
    lines = ["# The mechanism at the write-up's dose (issue 34 item 5; generated)", "",
             f"Pre-registration: [{os.path.basename(PREREG)}]({os.path.basename(PREREG)}). Command: "
             f"`python tools/study/dose_study.py --out {os.path.relpath(out, ROOT)}`; recipe `{RECIPE}` with "
             f"`{' '.join(_BASE)}`; every number is read from the runs' metrics.jsonl (raw files: `dose/`).", "",
             headline(out, stats, gate_ok), "", "## Calibration", ""] + _calibration_lines(state) + ["", "## Gates (steps 1-3, seed 0)", ""]
    for arm, g in state.get("gates", {}).items():
        lines += [f"**{arm}**", ""] + md_table(["gate", "result", "measured"],
                                               [[n, "pass" if ok else "**FAIL**", m] for n, ok, m in g]) + [""]
    lines += [f"## Main: {len(SEEDS)} seeds x {STEPS} steps per arm", ""] + _arm_table(stats)
    lines += ["", "## Verdicts (worded by the pre-registered rules)", ""]
    lines += [f"- **{hyp}**: {word}. {why}." for hyp, word, why in verdicts(stats, gate_ok)]
    missing = [f"{arm} seed {s}" for arm in ARMS for s in SEEDS if s not in {x["seed"] for x in stats[arm]}]
    lines += ["", "Not run (or incomplete): " + (", ".join(missing) if missing else "none") + ".", ""]
    with open(doc, "w") as f:
        f.write("\n".join(lines))
    return doc


def export_metrics(out: str, dest: str) -> List[str]:
    """Copies every run's metrics.jsonl / summary.json / process.json and the scout's dumps to ``dest``."""
    copied = []
    for path in sorted(glob.glob(os.path.join(out, "*", "*", "seed*", "*"))):
        name = os.path.basename(path)
        if name in ("metrics.jsonl", "summary.json", "process.json") or name.startswith("tokens_step"):
            target = os.path.join(dest, os.path.relpath(path, out))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(path, target)
            copied.append(target)
    return copied


# ----------------------------------------------------------------------------- the sweep

def run_stages(args) -> int:
    """Scout -> calibration -> gate probes -> main (seed-major), the page after each run."""
    out = args.out
    os.makedirs(out, exist_ok=True)
    experiments.ensure_pretrained_model(ROOT)

    def run(stage: str, arm: str, seed: int, steps: int, overrides: List[str]) -> bool:
        log_dir = os.path.abspath(os.path.join(out, stage, arm, f"seed{seed}"))
        cmd = experiments.train_command(RECIPE, _BASE + overrides, seed, log_dir, steps, 1, args.overrides)
        return experiments.run_one(cmd, log_dir, steps, cwd=ROOT)

    ok = run("scout", "B1", 0, PROBE_STEPS, arm_overrides("scout", 1.0))
    cal = calibrate(os.path.join(out, "scout", "B1", "seed0"), args.profile)
    over = {arm: arm_overrides(arm, cal["k"], cal["rare"], cal["k_common"]) for arm in ARMS}
    save_state(out, calibration=cal, overrides=over)
    for arm in ("B", "B2", "Brare"):
        ok &= run("gates", arm, 0, PROBE_STEPS, over[arm])
    probes = {arm: gates(read_rows(os.path.join(out, "gates", arm, "seed0"))) for arm in ("B", "B2", "Brare")}
    save_state(out, gates=probes)
    write_page(out)
    if args.stage == "probe":
        return 0 if ok else 1
    for block in BLOCKS:
        for seed in SEEDS:
            for arm in block:
                ok &= run("main", arm, seed, STEPS, over[arm])
                write_page(out)
    print(f"[dose] wrote {write_page(out)}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="study folder (stage/arm/seedK/metrics.jsonl, dose.json, page)")
    parser.add_argument("--profile", default=os.path.join(ROOT, "docs/results/beta-real/beta_real.csv"),
                        help="tools/study/beta_real.py's CSV (SmolLM2's rarity profile for B-rare)")
    parser.add_argument("--stage", choices=("probe", "all"), default="all")
    parser.add_argument("--page", default=None, metavar="DOC", help="only rewrite the page to DOC from OUT")
    parser.add_argument("--export", default=None, metavar="DIR", help="with --page: copy the raw metrics to DIR")
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
