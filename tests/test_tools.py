"""tools/: the sweep (2 runs x 2 steps), the figures (valid PNGs, one series per run) and the report."""

import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

pytestmark = pytest.mark.vllm

SMALL = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8",
         "logger.tensorboard=false", "logger.token_dump_steps=[1]"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, tiny_dense):
    out = str(tmp_path_factory.mktemp("sweep"))
    cmd = [sys.executable, "tools/sweep.py", "--grid", "tiny-phantom", "--runs", "A-bf16-autocast", "B-fp32-mismatch",
           "--steps", "2", "--seeds", "0", "--out", out, f"policy.model_name={tiny_dense}"] + SMALL
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, cmd


def test_sweep_writes_table_with_columns_and_is_resumable(sweep_dir):
    from sweep import COLUMNS

    out, cmd = sweep_dir
    with open(os.path.join(out, "summary.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["A-bf16-autocast", "B-fp32-mismatch"]
    assert list(rows[0]) == COLUMNS
    assert all(r["seeds"] == "1" for r in rows)
    assert float(rows[0]["beta_abs_mean"]) == 0.0 and float(rows[1]["beta_abs_mean"]) > 0.0
    assert "| run |" in open(os.path.join(out, "summary.md")).read()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done already") == 2


def test_figures_are_pngs_with_one_series_per_run(sweep_dir):
    import plot_metrics

    out, _ = sweep_dir
    runs = [os.path.join(out, r, "seed0") for r in ("A-bf16-autocast", "B-fp32-mismatch")]
    written = plot_metrics.make_figures(runs, os.path.join(out, "figs"))
    names = {os.path.basename(p) for p in written}
    assert {"beta.png", "alpha.png", "snr.png", "deployed_improvement.png", "clip_fractions.png",
            "beta_by_rarity.png"} <= names
    assert any(n.startswith("ratio_scatter") for n in names)
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    loaded = plot_metrics.load_runs(runs)
    fig = plot_metrics.line_figure(loaded, "precision/beta_abs_mean", "beta")
    assert len(fig.axes[0].get_lines()) == 2
    assert fig.axes[0].get_xlabel() == "step" and fig.axes[0].get_legend() is not None
    clip = plot_metrics.clip_figure(loaded)
    assert [len(ax.get_lines()) for ax in clip.axes] == [3, 3]


def test_report_combines_table_and_figures(sweep_dir):
    import report

    out, _ = sweep_dir
    path = report.build_report(out, seed=0, as_html=True)
    text = open(path).read()
    assert "| run |" in text and "figures/beta.png" in text and "ratio_scatter" in text
    assert os.path.isfile(os.path.join(out, "report.html"))


def test_moe_runs_get_routing_figures(tmp_path):
    import plot_metrics

    runs = []
    for name, mismatch in (("none", 0.004), ("R2", 0.0)):
        path = tmp_path / name
        path.mkdir()
        rows = [{"step": s, "precision/beta_abs_mean": 1e-3, "moe/route_mismatch_fraction": mismatch,
                 "moe/tokens_any_mismatch": 2 * mismatch, "precision/beta_abs_mean_route_match": 1e-3,
                 "precision/beta_abs_mean_route_mismatch": 1e-2 if mismatch else 0.0} for s in (1, 2, 3)]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(path))
    names = {os.path.basename(p) for p in plot_metrics.make_figures(runs, str(tmp_path / "figs"))}
    assert {"moe_route_mismatch.png", "moe_tokens_any_mismatch.png", "beta_by_routing.png"} <= names
    fig = plot_metrics.routing_beta_figure(plot_metrics.load_runs(runs))
    heights = [round(bar.get_height(), 6) for bar in fig.axes[0].patches]
    assert heights == [1e-3, 1e-2, 1e-3, 0.0]
