"""tools/: the sweep (2 runs x 2 steps), the figures (valid PNGs, one series per run), the report, and the
GPU check's CPU dry run."""

import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

vllm = pytest.mark.vllm  # the sweep runs the default generator (vLLM)

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


@vllm
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


@vllm
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


@vllm
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


@pytest.mark.slow
def test_gpu_check_dry_run_trains_runs_a_and_b(tmp_path):
    """``GPU_CHECK_DRY=1 tools/gpu_check.sh``: the device check's own script and phases on CPU (tiny
    model of the Qwen3-0.6B family written without transformers, no tokenizer, 2 steps per run of
    the real ``megatron-grpo train`` with generation.backend=megatron)."""
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_DRY="1", PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path / "work"))
    proc = subprocess.run(["bash", "tools/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "gpu_check: OK" in proc.stdout
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log", "run_A.metrics.jsonl",
                                       "run_B.metrics.jsonl"]  # small files only: the device returns few
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["ok"] and results["mode"] == "dry" and results["errors"] == []
    assert all(p["rc"] == 0 for p in results["phases"].values()) and set(results["phases"]) == {"beta", "runA", "runB"}
    a, b = results["runs"]["A"], results["runs"]["B"]
    assert a["steps_logged"] == b["steps_logged"] == 2
    assert a["precision/beta_abs_mean"] == [0.0, 0.0] and a["precision/beta_abs_max"] == [0.0, 0.0]  # matched
    assert all(v > 0 for v in b["precision/beta_abs_mean"])  # fp32 trainer vs bf16 generator
    for run in (a, b):
        assert all(t > 0 for t in run["time/step_s"]) and run["step_s_mean_after_first"] > 0
        for key in ("clip/phantom_region_fraction", "clip/phantom_zero_grad_fraction", "clip/legit_zero_grad_fraction"):
            assert all(0.0 <= v <= 1.0 for v in run[key]), key
    beta = results["beta"]
    assert beta["beta_abs_mean_bf16"] > beta["beta_abs_mean_fp16"] > 0  # fp16 keeps 3 more mantissa bits
    assert beta["tokens_common"] + beta["tokens_medium"] + beta["tokens_rare"] == beta["tokens"]
