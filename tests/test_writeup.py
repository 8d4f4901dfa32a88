"""tools/study/writeup.py: the writeup-pretrained grid resolves to valid configs, the table lr comes from the scan,
the statistics (95% t-intervals, interval comparisons) and the generated page on recorded metrics."""

import math
import os
import sys

import pytest

from tests.test_doctor import step_row, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "study"))

import writeup  # noqa: E402

from megatron_grpo.observe import experiments  # noqa: E402


def test_every_grid_run_is_a_valid_config_with_its_lr_and_variant():
    from megatron_grpo.config.recipe import load_recipe

    grid = writeup.grid()
    assert len(grid) == len(writeup.LRS) * (len(writeup.VARIANTS) + len(writeup.FAMILIES))
    cfg = load_recipe(os.path.join(ROOT, writeup.RECIPE), grid["G-lr0.0003"])
    assert (cfg.loss_fn.ratio, cfg.policy.precision.shadow_dtype, cfg.policy.megatron_cfg.optimizer.lr) == \
        ("shadow", "bfloat16", 3e-4)
    assert cfg.generation.max_staleness == 1 and cfg.loss_fn.ratio_clip_max == 0.2  # async, unscaled eps
    gspo = load_recipe(os.path.join(ROOT, writeup.RECIPE), grid["gspo-A-lr0.0001"])
    assert (gspo.loss_fn.clip, gspo.policy.precision.compute_dtype, gspo.loss_fn.ratio_clip_min) == \
        ("gspo", "bfloat16", 3e-4)
    for run in grid:  # every override is a known key with a valid value
        load_recipe(os.path.join(ROOT, writeup.RECIPE), grid[run])


def test_table_lr_is_the_scan_lr_with_the_largest_gap_ties_to_the_smaller():
    lrs = (1e-4, 3e-4, 1e-3)
    finals = {writeup.run_name("A", lr): {0: a, 1: a} for lr, a in zip(lrs, (-10.0, -4.0, -3.0))}
    finals.update({writeup.run_name("B", lr): {0: b, 1: b} for lr, b in zip(lrs, (-10.0, -9.0, -8.0))})
    assert writeup.choose_lr(finals, lrs) == 3e-4  # gaps 0, 5, 5: the smaller of the tie
    finals[writeup.run_name("B", 3e-4)][1] = math.nan  # a failed seed is left out, not a NaN gap
    assert writeup.choose_lr(finals, lrs) == 3e-4


def test_ci95_and_interval_comparison():
    mean, half, n = writeup.ci95([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert writeup.ci95([5.0, math.nan])[:3:2] == (5.0, 1) and math.isnan(writeup.ci95([5.0])[1])
    runs = lambda *xs: [{"seed": i, "final_reward": x} for i, x in enumerate(xs)]  # noqa: E731
    assert writeup.compare(runs(10.0, 5.1, 1.2), runs(9.0, 4.0, 0.0)).startswith("higher (difference 1.1 ± ")
    assert writeup.compare(runs(9.0, 4.0, 0.0), runs(10.0, 5.1, 1.2)).startswith("lower")  # paired: the spread
    assert writeup.compare(runs(1.0, 9.0), runs(4.0, 5.0)).startswith("indistinguishable")  # over seeds cancels
    assert writeup.compare(runs(1.0), runs(4.0, 5.0)) == "indistinguishable (difference -3, 1 seed: no interval)"


def _runs(root, lr, seeds):
    """A learns (reward -16 + step), B stalls at -15; B has phantom clipping, A none."""
    for s in seeds:
        for v in writeup.TABLE + list(writeup.FAMILIES):
            stalls = v != "A" and not v.endswith("-A")
            rows = [step_row(t, beta=0.02 if stalls else 0.0, phantom=0.1 if stalls else 0.0,
                             **{"reward/mean": (-15.0 - 0.1 * s) if stalls else (-16.0 + t + 0.1 * s),
                                "policy/deployed_improvement": 1e-3 if stalls else 5e-3})
                    for t in range(1, 31)]
            write_run(root / writeup.run_name(v, lr) / f"seed{s}", rows)


def test_report_reads_every_number_from_the_runs(tmp_path):
    lr = writeup.LRS[1]
    _runs(tmp_path, lr, seeds=(0, 1, 2))
    doc = writeup.write_report(str(tmp_path), lr, [0, 1], [0, 1, 2], threshold=-4.0, wall_s=600.0, eps=0.05)
    text = open(doc).read()
    assert "final reward A - B: higher (difference 27.2 ± 0.5, 3 paired seeds)" in text
    assert "**reproduced**" in text and "B falls behind A at some lr." in text
    assert "Deployed improvement A / B**: 5x" in text  # 5e-3 / 1e-3
    assert "| A | 3 | 12.1 ± 0.25 | 3/3 (step 12) |" in text  # mean of steps 26-30: -16 + 28 + 0.1 s
    assert "| B | 3 | -15.1 ± 0.25 | 0/3 |" in text
    assert "Budget: 42 runs + the gap probe" in text and "last sweep process ran 10.0 min" in text
    for fig in ("reward.png", "phantom.png", "snr.png", "lr_scan.png"):
        path = os.path.join(str(tmp_path), "writeup-reproduction", fig)
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n", fig
    # the report command rewrites the page elsewhere from writeup.json, keeping the recorded wall time
    import report

    report.main([str(tmp_path), "--writeup", str(tmp_path / "doc.md")])
    assert "last sweep process ran 10.0 min" in open(tmp_path / "doc.md").read()
    assert "clips at eps = **0.05**" in text and "scaled by 0.25" in text


def test_eps_is_the_writeups_unless_the_measured_gap_is_smaller():
    assert writeup.choose_eps([{"precision/beta_std": 0.3}, {"precision/beta_std": 0.2}]) == 0.2
    assert writeup.choose_eps([{"precision/beta_std": 0.0149}]) == pytest.approx(0.02)
    with pytest.raises(SystemExit, match="beta_std"):
        writeup.choose_eps([{"precision/beta_std": None}])


def test_staged_sweep_probes_eps_scans_lr_then_runs_table_and_families(tmp_path, monkeypatch):
    """``tools/study/writeup.py`` (``tools/study/sweep.py --grid writeup-pretrained``) with the training runs replaced by
    recorded metrics."""
    calls = []

    def fake_run(cmd, log_dir, steps, cwd=None):
        run = os.path.basename(os.path.dirname(log_dir))
        calls.append((run, cmd))
        good = run.startswith("A-") or "lr0.0003" in run  # B stalls at lr 1e-4 only: the table lr is 1e-4
        write_run(__import__("pathlib").Path(log_dir), [step_row(
            t, **{"precision/beta_std": 0.0149, "reward/mean": -5.0 if good else -15.0}) for t in range(1, steps + 1)])
        return True

    monkeypatch.setattr(experiments, "run_one", fake_run)
    monkeypatch.setattr(experiments, "ensure_pretrained_model", lambda root: None)
    out = str(tmp_path / "sweep")
    assert writeup.main(["--out", out, "--seeds", "0", "1", "--scan-lrs", "1e-4", "3e-4", "--family-seeds", "0"]) == 0
    runs = [r for r, _ in calls]
    probe = " ".join(calls[0][1])  # the gap probe first: run B, 2 steps, its own folder
    assert runs[0] == "B-lr0.0001" and "_gap-probe" in probe and "grpo.max_num_steps=2" in probe
    assert runs[1:5] == ["A-lr0.0001", "B-lr0.0001", "A-lr0.0003", "B-lr0.0003"]
    table = runs[5:5 + 2 * len(writeup.TABLE)]  # (run_one itself skips the scan's finished A and B seed 0)
    assert sorted(table) == sorted(writeup.run_name(v, 1e-4) for v in writeup.TABLE for _ in range(2))
    assert runs[5 + len(table):] == [writeup.run_name(f, 1e-4) for f in writeup.FAMILIES]
    noclip = next(c for r, c in calls if r.startswith("noclip"))  # the measured eps first, the run's own wins
    assert noclip.index("loss_fn.ratio_clip_min=0.02") < noclip.index("loss_fn.ratio_clip_min=10")
    text = open(os.path.join(out, "writeup-reproduction.md")).read()
    assert "The table lr is the scan lr with the largest mean gap A - B: **0.0001**" in text
    assert "eps = **0.02**" in text and "**reproduced**" in text


# ----------------------------------------------------------------------------- issue 26: writeup-regime

import writeup_regime as regime  # noqa: E402


def test_regime_grid_is_valid_megatron_synchronous_configs_and_matches_the_preregistration():
    from megatron_grpo.config.recipe import load_recipe

    grid, prereg = regime.grid(), open(os.path.join(ROOT, regime.PREREG)).read()
    assert set(grid) == {r for runs, _, _ in regime.STAGES.values() for r in runs}
    for run, overrides in grid.items():
        cfg = load_recipe(os.path.join(ROOT, writeup.RECIPE), regime.eps_overrides(0.0123) + overrides)
        assert (cfg.generation.backend, cfg.generation.max_staleness, cfg.policy.megatron_cfg.optimizer.lr) == \
            ("megatron", 0, regime.LR), run
        assert cfg.policy.precision.compute_dtype == ("bfloat16" if run.endswith("A") else "float32"), run
        assert cfg.loss_fn.ratio_clip_max == (regime.SCOUT_EPS if run == "scout-B" else 0.0123), run
        assert f"`{run}`: `{' '.join(overrides)}`" in prereg, run  # the page lists every run's exact overrides
    assert load_recipe(os.path.join(ROOT, writeup.RECIPE), grid["scout-B"]).logger.token_dump_steps == [1, 2, 3]
    assert load_recipe(os.path.join(ROOT, writeup.RECIPE), grid["F"]).loss_fn.ratio == "one"
    for number in (f"d = {regime.EQUIV_D:g}", f"{regime.MAIN_STEPS} steps", f"{regime.DOSE_STEPS} steps",
                   f"lr {regime.LR:g}", f"{regime.TARGET_PHANTOM:g}", f"{regime.MIN_A_GAIN:g}"):
        assert number in prereg, number


def test_eps_from_a_beta_sample_puts_the_target_share_outside_the_trust_region():
    import random

    rng = random.Random(0)
    sample = [rng.gauss(-0.001, 0.0119) for _ in range(4000)]
    eps = regime.eps_for_fraction(sample, 0.15)
    assert regime.fraction_outside(sample, eps) == pytest.approx(0.15, abs=1e-3)
    assert 1.3 * 0.0119 < eps < 1.6 * 0.0119  # half-normal: P(|x| > 1.44 sd) = 0.15
    assert regime.eps_for_fraction(sample, 0.30) < eps  # the 2x dose clips at a smaller eps
    # the box is asymmetric in log space: exp(-0.2) = 0.819 is outside [0.82, ...], exp(0.2) - 1 = 0.221 > 0.2
    assert regime.outside_distance(0.2) == pytest.approx(math.exp(0.2) - 1)
    assert regime.outside_distance(-0.2) == pytest.approx(1 - math.exp(-0.2))
    choice = regime.choose_eps(sample)
    assert choice["eps"] == eps and choice["eps_B-dose15"] == eps and choice["n_tokens"] == 4000
    with pytest.raises(ValueError, match="eps_for_fraction"):
        regime.eps_for_fraction([], 0.15)


def _probe_rows(alpha=0.0, region=0.0, snr=0.0, phantom=0.15, legit=0.0):
    return [{"step": t, "precision/alpha_abs_mean": alpha, "clip/region_fraction": region, "precision/snr": snr,
             "clip/phantom_region_fraction": phantom, "clip/legit_region_fraction": legit}
            for t in range(1, regime.PROBE_STEPS + 1)]


@pytest.mark.parametrize("a, b, failed", [
    ({}, {}, []),
    ({"alpha": 1e-9}, {}, [0]), ({"region": 0.01}, {}, [0]),  # A must be exact: any alpha or clip fails
    ({}, {"snr": 1.2}, [1]), ({}, {"snr": None}, [1]),  # a metric not logged fails its gate
    ({}, {"phantom": 0.05}, [2]), ({}, {"phantom": 0.25}, [2]), ({}, {"legit": 0.03}, [3]),
])
def test_gates_pass_and_fail_on_crafted_probe_metrics(a, b, failed):
    result = regime.gates(_probe_rows(**a), _probe_rows(**b))
    assert len(result) == 4 and [i for i, (_, ok, _) in enumerate(result) if not ok] == failed


def test_decision_rule_reproduced_not_reproduced_inconclusive():
    d = regime.EQUIV_D
    assert regime.decide([3.0, 3.2, 2.8, 3.1])[0] == "reproduced"  # CI > 0 and mean >= d
    assert regime.decide([1.0, 1.4, 0.6, 1.8])[0] == "inconclusive"  # real, below X, interval reaching past d
    assert regime.decide([0.5, 0.6, 0.55, 0.5])[0] == "not reproduced"  # real but inside [-d, d]: equivalent
    assert regime.decide([0.2, -0.3, 0.1, 0.0])[0] == "not reproduced"  # CI inside [-d, d]
    assert regime.decide([-3.0, -2.9, -3.1, -3.0])[0] == "not reproduced"  # the opposite direction
    assert regime.decide([4.0, -3.0, 2.0, -1.0])[0] == "inconclusive"  # too wide for either
    assert regime.decide([3.0])[0] == "inconclusive"  # one seed: no interval
    word, mean, half, n = regime.decide([d - 0.1, d + 0.1, d, d])  # mean exactly d, CI just > 0: reproduced
    assert (word, n) == ("reproduced", 4) and mean == pytest.approx(d)
    seeds = lambda key, *xs: [{"seed": i, key: x, "gain": 5.0} for i, x in enumerate(xs)]  # noqa: E731
    assert regime.h1_verdict(seeds("final_reward", -3, -3.2, -2.9, -3), seeds("final_reward", -9, -9, -8.8, -9.1))[0] \
        == "reproduced"
    no_learning = [dict(s, gain=0.5) for s in seeds("final_reward", -3, -3.2, -2.9, -3)]
    word, why = regime.h1_verdict(no_learning, seeds("final_reward", -9, -9, -8.8, -9.1))
    assert word == "inconclusive" and "validity needs >= 3" in why  # A did not learn: nothing to fail at
    f, lo, hi = (seeds("final_reward", *xs) for xs in ((-3, -3, -3), (-4, -4.2, -3.9), (-7, -7.5, -6.8)))
    assert regime.h2_verdict(f, lo, hi)[0] == "reproduced"
    assert regime.h2_verdict(f, hi, hi)[0] == "inconclusive"  # no growth with the dose
    assert regime.h2_verdict(f, f, f)[0] == "not reproduced"


def test_regime_sweep_stops_at_failed_gates_and_runs_main_and_dose_when_they_pass(tmp_path, monkeypatch):
    """``tools/study/writeup_regime.py`` (``tools/study/sweep.py --grid writeup-regime``) with the training runs replaced
    by recorded metrics."""
    import json
    import pathlib
    import random

    calls, phantom = [], {"value": 0.05}

    def fake_run(cmd, log_dir, steps, cwd=None):
        run, seed = os.path.basename(os.path.dirname(log_dir)), int(os.path.basename(log_dir)[4:])
        if len(experiments.read_rows(log_dir)) >= steps:  # as run_one: a complete run is reused
            return True
        calls.append((run, " ".join(cmd)))
        mismatched = run not in ("A", "probe-A")
        learns = run in ("A", "probe-A", "F")
        rows = [step_row(t, **{"precision/alpha_abs_mean": 0.0, "clip/region_fraction": phantom["value"] * mismatched,
                               "precision/snr": 0.0 if mismatched else math.nan,
                               "clip/phantom_region_fraction": phantom["value"] * mismatched,
                               "clip/legit_region_fraction": 0.0, "time/step_s": 2.0,
                               "reward/mean": (-12.0 + 0.2 * t if learns else -12.0) + 0.1 * seed})
                for t in range(1, steps + 1)]
        path = write_run(pathlib.Path(log_dir), rows)
        json.dump({"wall_s": 2.0 * steps + 30.0}, open(os.path.join(path, "summary.json"), "w"))  # the loop only
        json.dump({"process_wall_s": 2.0 * steps + 60.0}, open(os.path.join(path, "process.json"), "w"))
        if run == "scout-B":
            rng = random.Random(0)
            json.dump({"log_probs": [rng.gauss(0, 0.0119) for _ in range(2000)], "old_log_probs": [0.0] * 2000},
                      open(os.path.join(path, "tokens_step1.json"), "w"))
        return True

    monkeypatch.setattr(experiments, "run_one", fake_run)
    monkeypatch.setattr(experiments, "ensure_pretrained_model", lambda root: None)
    out = str(tmp_path / "regime")
    assert regime.main(["--out", out]) == 1  # phantom 0.05: gate 3 fails
    assert [r for r, _ in calls] == ["scout-B", "probe-A", "probe-B"]
    eps = json.load(open(os.path.join(out, "regime.json")))["eps_choice"]["eps"]
    assert f"loss_fn.ratio_clip_max={eps:.4g}" in calls[2][1] and "token_dump_steps" in calls[0][1]
    page = open(os.path.join(out, "writeup-regime.md")).read()
    assert "| **FAIL** |" in page and "do not count** (not run)" in page and "H1: pending (0/4 A" in page
    assert "**Headline**: gate(s) failed (B: clip/phantom_region_fraction in [0.1, 0.2]" in page
    # the gates pass: main (seed-major pairs) and dose run, each B dose at its own eps
    calls.clear()
    phantom["value"] = 0.15
    for probe in ("probe-A", "probe-B"):
        os.remove(os.path.join(out, "gates", probe, "seed0", "metrics.jsonl"))
    assert regime.main(["--out", out]) == 0
    runs = [r for r, _ in calls]
    assert runs[:2] == ["probe-A", "probe-B"] and runs[2:10] == ["A", "B"] * 4  # the scout is reused
    assert runs[10:] == ["F", "B-dose15", "B-dose30"] * 3
    choice = json.load(open(os.path.join(out, "regime.json")))["eps_choice"]
    dose30 = next(c for r, c in calls if r == "B-dose30")
    assert f"loss_fn.ratio_clip_max={choice['eps_B-dose30']:.4g}" in dose30 and "grpo.max_num_steps=40" in dose30
    page = open(os.path.join(out, "writeup-regime.md")).read()
    assert "**H1 (B ends worse than A): reproduced**: final-10 reward A - B = 13.1 ± " in page  # 0.2 * (65.5 - 0)
    assert "**H2 (the gap grows with the phantom dose): inconclusive**" in page  # both doses stall alike
    assert "failure is **reproduced** (H1); dose-response H2: **inconclusive**" in page
    assert "Estimated wall: main 0.4 h" in page and page.count("| pass |") == 4
    est = json.load(open(os.path.join(out, "regime.json")))["estimate"]  # launch-to-exit start-up: 60 s per run
    assert (est["main"], est["dose"]) == (8 * (70 * 2.0 + 60), 9 * (40 * 2.0 + 60))
    assert "Measured wall (sum of the runs' launch-to-exit times so far): probe 1.1 min, gates 2.2 min, " \
        "main 26.7 min, dose 21.0 min." in page
    # the report command writes the page elsewhere and exports the raw metrics
    import report

    report.main([out, "--regime", str(tmp_path / "doc.md"), "--export", str(tmp_path / "raw")])
    assert os.path.isfile(tmp_path / "raw" / "main" / "B" / "seed3" / "metrics.jsonl")
    assert os.path.isfile(tmp_path / "raw" / "probe" / "scout-B" / "seed0" / "tokens_step1.json")
    assert "reproduced" in open(tmp_path / "doc.md").read()


def test_sweep_hands_the_staged_grids_to_their_tools(monkeypatch):
    """``tools/study/sweep.py --grid writeup-pretrained|writeup-regime`` runs that tool with every other argument."""
    import sweep

    seen = []
    monkeypatch.setattr(sweep.subprocess, "call", lambda cmd, cwd: seen.append((cmd, cwd)) or 0)
    assert sweep.main(["--grid", "writeup-regime", "--out", "x", "--stage", "probe"]) == 0
    assert sweep.main(["--out", "y", "--grid", "writeup-pretrained", "--seeds", "0", "1"]) == 0
    assert [c[1:] for c, _ in seen] == [[os.path.join(ROOT, "tools", "study", "writeup_regime.py"), "--out", "x", "--stage",
                                         "probe"],
                                        [os.path.join(ROOT, "tools", "study", "writeup.py"), "--out", "y", "--seeds", "0", "1"]]
    assert {cwd for _, cwd in seen} == {ROOT}
