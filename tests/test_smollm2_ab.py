"""tools/study/smollm2_ab.py's pages (issue 42's two pre-registered studies), on synthetic metrics.jsonl files laid
out as the grids write them: the primary metric and the rule against an independent computation from the
pre-registrations' text (numpy, a t quantile integrated here), the diagnostic steps, missing metrics, partial
grids, the dose table and the caveats. No training run; each test takes well under a second."""

import dataclasses
import functools
import json
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "study"))
import smollm2_ab  # noqa: E402

DIAG = (1, 2, 3, 5, 10, 15, 20)
"""The pre-registrations' diagnostic steps for 20-step runs, written out by hand."""


def write_run(root, arm, seed, rewards, beta=0.0, every_step=False, extra=None, drop=()):
    """One run folder as the grid writes it: every step logs reward, step time and the zero-grad fraction; the
    diagnostic steps (every step with ``every_step``, as G and F do) log the gap, the clip classes and (diagnostic
    steps only) the deployed improvement. ``extra(step) -> dict`` overrides values; ``drop``: (step, key) left out."""
    folder = root / arm / f"seed{seed}"
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, reward in enumerate(rewards, 1):
            row = {"step": step, "reward/mean": reward, "time/step_s": 10.0 + step, "clip/zero_grad_fraction": 0.05}
            if every_step or step in DIAG:
                row.update({"precision/beta_abs_mean": beta, "clip/phantom_zero_grad_fraction": 0.1 if beta else 0.0,
                            "clip/legit_zero_grad_fraction": 0.01, **{f"precision/beta_abs_mean_{b}": beta * k
                                                                      for b, k in (("common", 1), ("medium", 2),
                                                                                   ("rare", 3))}})
            if step in DIAG:
                row["policy/deployed_improvement"] = 0.03
            row.update(extra(step) if extra else {})
            for s, key in drop:
                if s == step:
                    row.pop(key)
            f.write(json.dumps(row) + "\n")
    return folder


@functools.lru_cache(maxsize=None)
def t975(df):
    """The two-sided 95% Student t quantile, by bisection on the CDF integrated numerically (trapezoid)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x):
        xs = np.linspace(0.0, x, 8001)
        return 0.5 + np.trapezoid(c * (1 + xs ** 2 / df) ** (-(df + 1) / 2), xs)

    lo, hi = 0.0, 50.0
    for _ in range(40):
        lo, hi = ((lo + hi) / 2, hi) if cdf((lo + hi) / 2) < 0.975 else (lo, (lo + hi) / 2)
    return (lo + hi) / 2


def prereg_rule(diffs, d=2.0):
    """docs/results/preregistration-*.md, word for word: reproduced if the 95% t-interval of the mean paired
    difference excludes 0 on the positive side and the mean is >= d; not reproduced if the interval lies inside
    [-d, d] or wholly below 0; inconclusive otherwise."""
    x = np.asarray(diffs, float)
    mean, half = x.mean(), t975(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    lo, hi = mean - half, mean + half
    word = ("reproduced" if lo > 0 and mean >= d else
            "not reproduced" if (-d <= lo and hi <= d) or hi < 0 else "inconclusive")
    return word, mean, half


def test_primary_metric_and_rule_match_the_preregistration(tmp_path):
    """Final reward = mean reward/mean of steps 16-20 per seed, paired by seed, 95% t with n - 1 df: the page's
    verdicts and per-seed numbers equal an independent computation on 3 seeds x 20 steps of noisy rewards."""
    rng = np.random.default_rng(0)
    rewards = {}
    for seed in range(3):
        base = np.linspace(-28, -12, 20) + rng.normal(0, 1.5, 20)
        for arm, shift in (("A", 0.0), ("B", -4.0 - seed), ("G", -3.0 + 1.5 * seed), ("F", -3.9 - 0.8 * seed),
                           ("noclip", -1.0 + 3.0 * seed)):
            rewards[arm, seed] = [float(r) for r in base + shift * np.linspace(0, 1, 20) ** 2]
            write_run(tmp_path, arm, seed, rewards[arm, seed], beta=0.0 if arm == "A" else 0.05)
    final = {k: np.mean(v[15:20]) for k, v in rewards.items()}  # steps 16..20 (step s at index s - 1)
    stats = smollm2_ab.collect(str(tmp_path), 20)
    for arm in smollm2_ab.ARMS:
        assert [s["final_reward"] for s in stats[arm]] == pytest.approx([final[arm, s] for s in range(3)], abs=1e-12)
        assert [s["gain"] for s in stats[arm]] == pytest.approx(
            [final[arm, s] - np.mean(rewards[arm, s][:2]) for s in range(3)], abs=1e-12)
    text = smollm2_ab.page(str(tmp_path), 20, "cmd", seeds=[0, 1, 2])
    words = []
    for arm, label in (("A", "H1"), ("G", "H2"), ("F", "H3a"), ("noclip", "H3b")):
        word, mean, half = prereg_rule([final[arm, s] - final["B", s] for s in range(3)])
        line = next(ln for ln in text.splitlines() if ln.startswith(f"- **{label}: "))
        assert f"**: {word} (difference {mean:.3g} ± {half:.2g}, 3 paired seeds" in line, (arm, line)
        words.append(word)
    assert len(set(words)) == 3  # the data exercise all three words of the rule
    for df in range(1, 10):  # the table behind ci95 is the t quantile with n - 1 degrees of freedom
        assert smollm2_ab.experiments.T975[df] == pytest.approx(t975(df), abs=6e-4)


def test_precision_columns_average_the_same_diagnostic_steps_in_every_arm(tmp_path):
    """G and F log the gap and the clip classes at every step, B only at the diagnostic steps: the per-arm mean
    |beta| and phantom / legit zero-grad read the diagnostic steps 1, 2, 3, 5, 10, 15, 20 in every arm."""
    rewards = list(np.linspace(-28.0, -12.0, 20))
    write_run(tmp_path, "B", 0, rewards, beta=0.05)
    off_diag = lambda step: {} if step in DIAG else {"precision/beta_abs_mean": 0.5, "clip/legit_zero_grad_fraction": 0.3}
    write_run(tmp_path, "G", 0, rewards, beta=0.05, every_step=True, extra=off_diag)
    stats = smollm2_ab.collect(str(tmp_path), 20)
    for arm in ("B", "G"):
        assert stats[arm][0]["beta_abs_mean"] == pytest.approx(0.05)
        assert stats[arm][0]["legit_zero_grad"] == pytest.approx(0.01)
    assert smollm2_ab.diag_steps(20) == list(DIAG)


def test_a_missing_metric_or_a_repeated_step_is_an_error_naming_it(tmp_path):
    rewards = list(np.linspace(-28.0, -12.0, 20))
    write_run(tmp_path, "B", 0, rewards, beta=0.05, drop=[(3, "clip/legit_zero_grad_fraction")])
    with pytest.raises(LookupError, match=r"'clip/legit_zero_grad_fraction' at step 3 .*logged at steps \[1, 2, 5"):
        smollm2_ab.collect(str(tmp_path), 20)
    folder = write_run(tmp_path, "A", 1, rewards)
    with open(folder / "metrics.jsonl", "a") as f:  # a resumed run that appended its step 20 twice
        f.write(json.dumps({"step": 20, "reward/mean": 0.0}) + "\n")
    with pytest.raises(ValueError, match="A/seed1/metrics.jsonl: steps .* are not 1..21"):
        smollm2_ab.collect(str(tmp_path), 20, arms=("A",))


def test_a_partial_grid_lists_every_run_and_gives_no_interval_from_one_seed(tmp_path):
    """Seed 0 complete for A and B; A seed 1 stopped at step 5; B seed 1 a failed launch (train.log and
    process.json only); nothing else: the page lists all 15 runs with their status, reads only the complete ones,
    prints no interval from one paired seed, and says the study is not finished; the seed-order caveat is there."""
    rewards = list(np.linspace(-28.0, -12.0, 20))
    write_run(tmp_path, "A", 0, rewards)
    write_run(tmp_path, "B", 0, [r - 4 for r in rewards], beta=0.05)
    write_run(tmp_path, "A", 1, [-30.0] * 5)
    failed = tmp_path / "B" / "seed1"
    failed.mkdir()
    (failed / "train.log").write_text("INFO starting\nerror: policy.model_name: runs/x is not a checkpoint dir\n")
    (failed / "process.json").write_text(json.dumps({"process_wall_s": 6.5, "returncode": 2}))
    text = smollm2_ab.page(str(tmp_path), 20, "cmd", seeds=[0, 1, 2])
    assert "| A | 1 | incomplete | 5 of 20 steps (running or stopped): left out |" in text
    assert ("| B | 1 | no metrics | no metrics: its last recorded launch exited 2: `error: policy.model_name: runs/x "
            "is not a checkpoint dir` |") in text
    assert "| G | 0 | not started |" in text and "| noclip | 2 | not started |" in text
    assert "Complete runs: 2 of 15; the study is not finished" in text
    assert "nan" not in text.split("## Per arm")[0]
    assert ("**: inconclusive (1 paired seed, so no interval: the rule needs 2 or more; difference 4; d = 2)."
            in text)
    assert "**H2: taking the clip's ratio from the bf16 shadow (G) recovers B's loss**: no verdict" in text
    per_arm = text.split("## Per arm")[1]
    assert f"| A | 1 | {np.mean(rewards[:2]):.3g} | {np.mean(rewards[15:]):.3g} |" in per_arm  # the 5-step seed 1 is not averaged in
    for study in smollm2_ab.STUDIES.values():
        assert smollm2_ab.SEED_ORDERS in study.caveats
    assert "paired arm differences are unbiased" in text and "less independent" in text


def test_fp8_dose_table_beside_the_writeup_the_bf16_reference_and_the_scout(tmp_path):
    """The FP8 page: B8's steps 1-3 (an incomplete run too, marked), an empty rarity bucket read as empty (not as
    0), the reference rows, the write-up's 12.5 pp / 0.076, whether B8 seed 0 repeats the scout, the missing
    grad/cos_clean said, and no verdict without pairs."""
    empty_rare = lambda step: {"precision/beta_abs_mean_rare": 0.0, **(
        {"precision/beta_abs_mean_medium": None} if step == 2 else {})}  # null: how the logger writes it now
    run = write_run(tmp_path / "grid", "B8", 0, [-28.0, -27.0, -29.5, -28.0, -27.0, -26.0], beta=0.18,
                    extra=empty_rare)
    write_run(tmp_path / "grid", "M", 0, list(np.linspace(-28.0, -12.0, 20)))
    ref = write_run(tmp_path / "ref", "B", 0, [-29.0] * 3, beta=0.04, every_step=True)
    scout = tmp_path / "scout" / "B8" / "seed0"
    scout.mkdir(parents=True)
    rows = [json.loads(ln) for ln in open(run / "metrics.jsonl")][:3]
    rows[1]["reward/mean"] = -27.5  # the scout's step 2 differs
    scout.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    study = dataclasses.replace(smollm2_ab.STUDIES["fp8-dose"], repeats=str(tmp_path / "scout"),
                                dose_reference=("bf16 ref", str(ref.parent)))
    text = smollm2_ab.page(str(tmp_path / "grid"), 20, "cmd", study, seeds=[0, 1, 2])
    # B8: phantom 0.1, legit 0.01, beta 0.18 at steps 1-3; common 0.18; medium 0.36 at steps 1 and 3 (empty at 2)
    assert ("| B8 | 0 (6 steps so far) | 0.1 | 0.1 | 0.1 | 0.01 | 0.01 | 0.01 | 0.18 | 0.18 | 0.18 | 0.18 | 0.18 "
            "| 0.36 | no tokens |") in text
    assert "| bf16 ref | 0 | 0.1 | 0.1 | 0.1 | 0.01 | 0.01 | 0.01 | 0.04 | 0.04 | 0.04 | 0.04 | 0.04 | 0.08 | 0.12 |" in text
    assert ("| write-up (Qwen3-0.6B) | 1 |  |  | ~0.125 (13.5% - 1.0%) |  |  | ~0.01 |  |  |  | 0.076 (its run's "
            "mean) | ~0.02 | ~0.1 (lp near -10) | 0.5-1.0 |") in text
    assert "- B8 seed 0: differs from step 2 (reward/mean: -27.5 there, -27 here; 1 of 9 values differ" in text
    assert "`grad/cos_clean` (pre-registered secondary): logged by no complete run" in text
    assert "**H1: B8 (the bf16 trainer's ratio with the FP8 gap) ends below M (bf16 generator, matched)**: " \
           "no verdict (no seed has complete runs of both arms)." in text
    assert "| M | 0 |" not in text.split("## Repeats")[0].split("## The dose")[1]  # the matched arm has no gap
    for s in smollm2_ab.STUDIES.values():  # the pages' reference folders are in the repository
        assert os.path.isdir(os.path.join(ROOT, s.repeats)), s.repeats
        assert not s.dose_reference or os.path.isdir(os.path.join(ROOT, s.dose_reference[1]))


def test_smollm2_ab_page_reads_complete_runs_and_pairs_seeds(tmp_path):
    """The A-vs-B page: per-arm means over complete runs only, paired differences by seed, raw files exported."""
    steps = 6
    for seed, lift in ((0, 0.0), (1, 1.0)):
        write_run(tmp_path, "A", seed, [-20.0, -20.0, -16, -14, -12, -10 + lift])
        write_run(tmp_path, "B", seed, [-20.0, -20.0, -18, -17, -16, -15], beta=0.04)
    write_run(tmp_path, "B", 2, [-20.0] * 3)  # incomplete: left out
    stats = smollm2_ab.collect(str(tmp_path), steps)
    assert [s["seed"] for s in stats["B"]] == [0, 1]
    a0 = stats["A"][0]
    assert a0["final_reward"] == pytest.approx((-20 - 16 - 14 - 12 - 10) / 5) and a0["reward_1_2"] == -20
    assert stats["B"][0]["beta_abs_mean"] == pytest.approx(0.04) and stats["B"][0]["step_s"] == 14.0
    assert stats["B"][0]["phantom_zero_grad_3"] == 0.1 and stats["A"][0]["phantom_zero_grad_3"] == 0
    text = smollm2_ab.page(str(tmp_path), steps, "cmd")
    assert "| A | 2 |" in text and "| B | 2 |" in text and "| write-up (Qwen3-0.6B) | 1 |" in text
    # A - B per seed: 2.8 and 3.0 (final rewards -14.4 / -14.2 vs -17.2): both positive, interval above 0
    assert "**H1: B (the fp32 trainer's ratio with the bf16 gap) ends below A (precision-matched)**: reproduced (" in text
    assert smollm2_ab.export(str(tmp_path), str(tmp_path / "out")) == 5
    assert smollm2_ab.verdict([4.0, 4.5, 5.0], a_gain=10).startswith("reproduced (difference 4.5 ± 1.2, 3 paired")
    assert smollm2_ab.verdict([0.5, -0.5, 0.0], a_gain=10).startswith("not reproduced")  # inside [-2, 2]
    assert smollm2_ab.verdict([1.0, 9.0, -3.0], a_gain=10).startswith("inconclusive (difference")
    assert smollm2_ab.verdict([4.0, 4.5, 5.0], a_gain=2).startswith("inconclusive (A's gain 2 < 5)")
    for seed, lift in ((0, 0.0), (1, 1.0)):  # the FP8 study: M matched, B8 the baseline
        write_run(tmp_path, "M", seed, [-20.0, -20.0, -16, -14, -12, -10 + lift])
        write_run(tmp_path, "B8", seed, [-20.0, -20.0, -18, -17, -16, -15], beta=0.18)
        write_run(tmp_path, "T8", seed, [-20.0, -20.0, -18, -17, -16, -15 - lift], beta=0.18)
    text = smollm2_ab.page(str(tmp_path), steps, "cmd", smollm2_ab.STUDIES["fp8-dose"])
    assert "**H1: B8 (the bf16 trainer's ratio with the FP8 gap) ends below M (bf16 generator, matched)**: " \
           "reproduced (" in text
    # T8 - B8 per seed: 0 and -0.2: inside [-2, 2]
    assert "**S1: token TIS with cap 2 (T8) ends above B8 (secondary)**: not reproduced (difference -0.1" in text
    assert "**H2: taking the clip's ratio from the fp8 shadow (G8, unified FP8) recovers B8's loss**: no verdict" in text
