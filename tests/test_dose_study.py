"""tools/study/dose_study.py (issue 34 item 5): every arm is a valid config at the pre-registered regime, the
pre-registration states the tool's constants, the calibration of k and of B-rare's k_t, the gates, the
verdicts and the generated page on synthetic metrics."""

import csv
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "study"))

import dose_study as dose  # noqa: E402


def test_arms_are_valid_configs_and_the_preregistration_states_the_constants():
    from megatron_grpo.config.recipe import load_recipe

    for arm in dose.ARMS + ("scout",):
        cfg = load_recipe(os.path.join(ROOT, dose.RECIPE), dose._BASE + dose.arm_overrides(
            arm, 9.5, [[-20.0, 40.0], [-10.0, 20.0], [-5.0, 12.0]], 8.0))
        assert (cfg.generation.backend, cfg.generation.max_staleness, cfg.policy.precision.compute_dtype,
                cfg.policy.precision.generation_dtype) == ("megatron", 1, "float32", "bfloat16")
        assert cfg.policy.megatron_cfg.optimizer.lr == dose.LR
        expected = {"G": 0.0, "B": 9.5, "B2": 19.0, "noclip": 9.5, "Brare": 8.0, "scout": 1.0}
        if arm == "F":
            assert cfg.loss_fn.ratio == "one"
        else:
            assert (cfg.loss_fn.ratio, cfg.loss_fn.gap_scale) == ("gap_scaled", expected[arm])
        assert cfg.loss_fn.ratio_clip_max == (10.0 if arm == "noclip" else dose.EPS)
    rare = load_recipe(os.path.join(ROOT, dose.RECIPE), dose._BASE + dose.arm_overrides("Brare", 1.0, [[-20.0, 4.0]], 2.0))
    assert rare.loss_fn.gap_scale_by_logprob == [[-20.0, 4.0]]
    prereg = open(os.path.join(ROOT, dose.PREREG)).read()
    for name in ("LR", "EPS", "TARGET_GAP", "PROBE_STEPS", "STEPS", "FIRST_STEPS", "FINAL_LAST", "EQUIV_D",
                 "MIN_G_GAIN", "DI_REPRODUCED", "DI_NOT", "SNR_MAX", "PHANTOM_ZERO_MIN", "LEGIT_MAX",
                 "MIN_BUCKET_TOKENS"):
        value = getattr(dose, name)
        assert f"{name} = {value:g}" in prereg or f"{name} = {value}" in prereg, name
    assert "SEEDS = 0, 1, 2" in prereg and "G (k = 0), B (k), F (ratio one: REINFORCE), B2 (2k), noclip (k, eps 10), Brare (k_t)" in prereg
    assert dose.SEEDS == (0, 1, 2) and dose.ARMS == ("G", "B", "F", "B2", "noclip", "Brare")
    assert dose.BLOCKS == (("G", "B", "F"), ("B2", "noclip", "Brare")) and "first G, B, F for seeds 0, 1, 2" in prereg
    assert dose.SMOLLM2_PAIR in prereg


def test_calibration_follows_the_smollm2_profile_at_the_target_mean(tmp_path):
    profile = tmp_path / "beta_real.csv"
    cols = ["pair"] + [f"{k}_{b[0]}" for b in dose.BUCKETS for k in ("beta_abs", "n")]
    with open(profile, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerow({"pair": dose.SMOLLM2_PAIR, "beta_abs_gt-5": 0.02, "n_gt-5": 1000, "beta_abs_-10..-5": 0.06,
                    "n_-10..-5": 100, "beta_abs_-20..-10": 0.2, "n_-20..-10": 20, "beta_abs_le-20": 5.0,
                    "n_le-20": 3})  # too few: takes -20..-10's 10x
    prof = dose.smollm2_profile(str(profile))
    assert prof == pytest.approx({"gt-5": 1.0, "-10..-5": 3.0, "-20..-10": 10.0, "le-20": 10.0})
    # our model: |beta| 0.01 everywhere; tokens in every bucket
    tokens = [(0.01, -1.0)] * 80 + [(-0.01, -7.0)] * 10 + [(0.01, -15.0)] * 5 + [(0.01, -25.0)] * 5
    k_common, rare = dose.rare_scales(tokens, prof)
    ks = {"gt-5": k_common, "-10..-5": rare[2][1], "-20..-10": rare[1][1], "le-20": rare[0][1]}
    assert [r[0] for r in rare] == [-20.0, -10.0, -5.0]
    assert ks["-10..-5"] / ks["gt-5"] == pytest.approx(3.0) and ks["le-20"] / ks["gt-5"] == pytest.approx(10.0)
    mean_gap = sum(abs(b) * ks[dose.bucket_of(lp)] for b, lp in tokens) / len(tokens)
    assert mean_gap == pytest.approx(dose.TARGET_GAP)
    run = tmp_path / "scout"
    run.mkdir()
    json.dump({"log_probs": [-1.0, -7.0], "shadow_log_probs": [-1.02, -6.99], "old_log_probs": [-1.1, -7.1]},
              open(run / "tokens_step1.json", "w"))
    cal = dose.calibrate(str(run), str(profile))
    assert cal["beta_abs_mean"] == pytest.approx(0.015) and cal["k"] == pytest.approx(dose.TARGET_GAP / 0.015)


def _rows(arm, seed, steps=dose.STEPS):
    """G learns (reward -16 + 0.15 step), B learns at a third of the rate; B has phantom zero-grads."""
    rate = {"G": 0.15, "F": 0.15, "noclip": 0.14}.get(arm, 0.05)
    rows = []
    for s in range(1, steps + 1):
        rows.append({"step": s, "reward/mean": -16 + rate * s + 0.01 * seed, "policy/deployed_improvement": rate / 10,
                     "clip/phantom_zero_grad_fraction": 0.0 if arm in ("G", "F", "noclip") else 0.12,
                     "clip/legit_region_fraction": 0.01, "precision/snr_in_ratio": 0.3 if s > 1 else 0.0,
                     "precision/gap_in_ratio_abs_mean": 0.07, "grad/cos_clean": 0.9 if s % 10 == 0 else None})
    return rows


def test_gates_verdicts_and_page(tmp_path):
    out = tmp_path / "dose"
    for arm in dose.ARMS:
        for seed in dose.SEEDS:
            d = out / "main" / arm / f"seed{seed}"
            d.mkdir(parents=True)
            with open(d / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in _rows(arm, seed))
    gates = dose.gates(_rows("B", 0, dose.PROBE_STEPS))
    assert [ok for _, ok, _ in gates] == [True, True, True]
    failing = [dict(r, **{"clip/legit_region_fraction": 0.05}) for r in _rows("B", 0, 3)]
    assert [ok for _, ok, _ in dose.gates(failing)] == [True, True, False]
    assert not dose.gates([])[0][1]  # nothing logged fails
    dose.save_state(str(out), gates={"B": gates, "B2": dose.gates(failing)},
                    calibration=dict(n_tokens=100, beta_abs_mean=0.007, k=10.0, k_common=8.0, rare=[[-20.0, 30.0]],
                                     by_bucket={"gt-5": [90], "le-20": [10]}))
    stats = {arm: dose.arm_stats(str(out), arm) for arm in dose.ARMS}
    words = {h.split(":")[0]: w for h, w, _ in dose.verdicts(stats, {"B": True, "B2": False})}
    assert words["H1"] == "reproduced" and words["H2"] == "reproduced" and words["validity"] == "yes"
    assert words["H1b"] == "reproduced (flagged: the arm's gate failed)"
    page = open(dose.write_page(str(out))).read()
    assert "**H1: G - B (final reward)**: reproduced" in page and "Not run (or incomplete): none." in page
    assert "k = 0.07 / that = **10**" in page
    (out / "main" / "Brare" / "seed2" / "metrics.jsonl").write_text("")
    assert "Not run (or incomplete): Brare seed 2." in open(dose.write_page(str(out))).read()
    assert dose.di_verdict([], [])[0] == "inconclusive"
