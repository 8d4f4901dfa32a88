"""tools/writeup.py: the writeup-pretrained grid resolves to valid configs, the table lr comes from the scan,
the statistics (95% t-intervals, interval comparisons) and the generated page on recorded metrics."""

import math
import os
import sys

import pytest

from tests.test_doctor import step_row, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import writeup  # noqa: E402


def test_every_grid_run_is_a_valid_config_with_its_lr_and_variant():
    import sweep
    from megatron_grpo.recipe import load_recipe

    grid = sweep.GRIDS["writeup-pretrained"]
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
    """``tools/sweep.py --grid writeup-pretrained`` with the training runs replaced by recorded metrics."""
    import sweep

    calls = []

    def fake_run(cmd, log_dir, steps):
        run = os.path.basename(os.path.dirname(log_dir))
        calls.append((run, cmd))
        good = run.startswith("A-") or "lr0.0003" in run  # B stalls at lr 1e-4 only: the table lr is 1e-4
        write_run(__import__("pathlib").Path(log_dir), [step_row(
            t, **{"precision/beta_std": 0.0149, "reward/mean": -5.0 if good else -15.0}) for t in range(1, steps + 1)])
        return True

    monkeypatch.setattr(sweep, "run_one", fake_run)
    monkeypatch.setattr(writeup, "ensure_model", lambda: None)
    out = str(tmp_path / "sweep")
    assert sweep.main(["--grid", "writeup-pretrained", "--out", out, "--seeds", "0", "1", "--scan-lrs", "1e-4", "3e-4",
                       "--family-seeds", "0"]) == 0
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
