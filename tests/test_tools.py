"""tools/: the sweep (2 runs x 2 steps), the figures (valid PNGs, one series per run), the report, and the
GPU check's CPU dry run."""

import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tools", kind) for kind in ("study", "bench", "cluster")]

vllm = pytest.mark.vllm  # the sweep runs the default generator (vLLM)

SMALL = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8",
         "logger.tensorboard=false", "logger.token_dump_steps=[1]"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, tiny_dense):
    out = str(tmp_path_factory.mktemp("sweep"))
    cmd = [sys.executable, "tools/study/sweep.py", "--grid", "tiny-phantom", "--runs", "A-bf16-autocast", "B-fp32-mismatch",
           "--steps", "2", "--seeds", "0", "--out", out, f"policy.model_name={tiny_dense}"] + SMALL
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, cmd


@vllm
def test_sweep_writes_table_with_columns_and_is_resumable(sweep_dir):
    from megatron_grpo.observe.experiments import SUMMARY_COLUMNS as COLUMNS

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
    """``GPU_CHECK_DRY=1 tools/cluster/gpu_check.sh``: the device check's own script and every phase on CPU (tiny
    model of the Qwen3-0.6B family written without transformers, no tokenizer; smoke = 1 step, A / shadow /
    fp16 / B = 2 steps of the real ``megatron-grpo train`` with generation.backend=megatron)."""
    from gpu_check import PHASES

    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_DRY="1", PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path / "work"))
    env.pop("GPU_CHECK_PHASES", None)
    proc = subprocess.run(["bash", "tools/cluster/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=960)  # above the dry run's own limit (900 s)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "gpu_check: OK" in proc.stdout
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log", "run_A.metrics.jsonl", "run_B.metrics.jsonl",
                                       "run_fp16.metrics.jsonl", "run_shadow.metrics.jsonl",
                                       "run_smoke.metrics.jsonl"]  # small files only
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["ok"] and results["finished"] and results["running"] is None and results["mode"] == "dry"
    phases = results["phases"]
    assert list(phases) == list(PHASES) and all(p["status"] == "ok" and p["seconds"] > 0 for p in phases.values())
    assert PHASES.index("fp16") < PHASES.index("B")  # the loss-scaling run is not the first one skipped
    pre = phases["preflight"]["measurements"]
    assert pre["problems"] == [] and pre["device"] == "cpu" and pre["work_free_gib"] > 0
    assert all(pre["imports"][m]["ok"] for m in ("megatron.core", "omegaconf", "yaml", "safetensors"))
    smoke = phases["smoke"]["measurements"]
    assert smoke["steps_logged"] == 1 and all(v > 0 for v in smoke["train/grad_norm"])
    a, b, fp16, shadow = (phases[n]["measurements"] for n in ("A", "B", "fp16", "shadow"))
    assert a["steps_logged"] == b["steps_logged"] == fp16["steps_logged"] == shadow["steps_logged"] == 2
    # fp32 params, bf16 compute, a forced fp16 shadow: the shadow forward runs, so beta is measured (not 0)
    assert "policy.precision.shadow_dtype=float16" in shadow["recipe"]
    assert all(0 < v < float("inf") for v in shadow["precision/beta_abs_mean"] + shadow["precision/beta_abs_max"])
    for matched in (a, fp16):  # precision-matched: trainer and generator compute alike
        assert matched["precision/beta_abs_mean"] == [0.0, 0.0] and matched["precision/beta_abs_max"] == [0.0, 0.0]
    assert all(v > 0 for v in b["precision/beta_abs_mean"])  # fp32 trainer vs bf16 generator
    assert all(v > 1 for v in fp16["train/loss_scale"])  # fp16: Megatron's dynamic loss scaler is on
    for run in (a, b, fp16, shadow):
        assert all(t > 0 for t in run["time/step_s"]) and run["step_s_mean_after_first"] > 0
        for key in ("clip/phantom_region_fraction", "clip/phantom_zero_grad_fraction", "clip/legit_zero_grad_fraction"):
            assert all(0.0 <= v <= 1.0 for v in run[key]), key
    beta = phases["beta"]["measurements"]
    assert beta["beta_bf16_abs_mean"] > beta["beta_fp16_abs_mean"] > 0  # fp16 keeps 3 more mantissa bits
    assert beta["tokens_common"] + beta["tokens_medium"] + beta["tokens_rare"] == beta["tokens"]
    # the fp64 reference: fp32 sits ~1e-7 from it, the low precisions ~1e-4..1e-2; with fp32 ~ fp64, the
    # error of bf16 / fp16 vs fp64 is their beta vs fp32
    fp32_err = beta["err_vs_fp64_fp32_abs_mean"]
    assert 0 < fp32_err < 1e-5 and beta["err_vs_fp64_fp32_abs_max"] < 1e-5
    for low in ("bf16", "fp16"):
        assert beta[f"err_vs_fp64_{low}_abs_mean"] > 50 * fp32_err
        assert beta[f"err_vs_fp64_{low}_abs_mean"] == pytest.approx(beta[f"beta_{low}_abs_mean"], abs=1e-5)
    fp8 = phases["fp8"]["measurements"]  # our emulated FP8 GEMM vs torch._scaled_mm's on the same bytes
    assert fp8["weight_block_size"] == [32, 32] and fp8["num_fp8_linears"] == 2 * 4 and fp8["gemm_equal_fraction"] > 0.5
    assert 0 < fp8["lp_residual_abs_mean"] <= 2 * fp8["lp_fp32_noise_abs_mean"] < 2 * fp8["lp_fp8_gap_abs_mean"]
    notes = "\n".join(results["not_measured"])
    assert "vLLM generation" in notes and "Transformer Engine GEMMs" in notes and "dry run on CPU" in notes
    assert "vLLM's FP8 kernels" in notes
    assert not any(n.startswith(f"{p} (") for n in results["not_measured"] for p in PHASES)  # every phase ran



def test_gpu_check_shadow_phase_forces_a_shadow_and_needs_a_finite_nonzero_beta():
    """The shadow phase: run A's recipe (fp32 params, bf16 compute and generator) with an fp16 shadow, so the
    shadow forward runs; its beta must be finite and > 0 (A's and fp16's 0 holds with no shadow at all).
    fp16, the only loss-scaling run, comes before B (the last phase is the first one skipped)."""
    import gpu_check as gc
    from megatron_grpo.config.recipe import load_recipe

    cfg = load_recipe(os.path.join(ROOT, gc.RUNS["shadow"]), gc.RUN_OVERRIDES["shadow"])
    p = cfg.policy.precision
    assert (p.params_dtype, p.compute_dtype, p.generation_dtype, p.shadow_dtype) == \
        ("float32", "bfloat16", "bfloat16", "float16") and p.needs_shadow
    assert not load_recipe(os.path.join(ROOT, gc.RUNS["A"]), []).policy.precision.needs_shadow
    assert gc.PHASES.index("A") < gc.PHASES.index("shadow") < gc.PHASES.index("fp16") < gc.PHASES.index("B")

    def run(beta):
        finite = [b for b in beta if b == b]
        return {"steps_logged": 2, "steps_planned": 2, "time/step_s": [1.0, 1.0], "loss/policy": [0.1, 0.2],
                "precision/beta_abs_mean": beta, "precision/beta_abs_max": beta,
                "precision/beta_abs_mean:mean": sum(finite) / len(finite) if finite else None}

    assert gc.run_errors("shadow", run([1e-3, 2e-3])) == [] and gc.run_errors("A", run([0.0, 0.0])) == []
    assert "must have beta finite and > 0" in gc.run_errors("shadow", run([0.0, 0.0]))[0]
    assert gc.run_errors("shadow", run([1e-3, float("nan")]))  # a NaN shadow step fails too
    assert "exactly 0" in gc.run_errors("A", run([1e-3, 0.0]))[0]

def test_gpu_check_phase_runner_records_each_phase_atomically(tmp_path):
    """The phase runner without training: the JSON on disk before, during and after each phase; failed
    (with the measurements, NaN included) / skipped (not selected, over budget, its estimate raised by
    an earlier run of its group) / a crash; an interrupt leaves a valid JSON naming the killed phase."""
    from megatron_grpo.observe import phases as runner

    path = str(tmp_path / "gpu_check.json")
    now = [0.0]
    calls = []

    def on_disk():
        with open(path) as f:  # strict JSON: a NaN literal would raise here
            return json.load(f, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))

    def phase(name, seconds, result=None, error=None):
        def run(timeout_s):
            disk = on_disk()
            calls.append((name, timeout_s, disk["running"], {n: p["status"] for n, p in disk["phases"].items()}))
            now[0] += seconds
            if error:
                raise error
            return result

        return run

    failure = runner.PhaseFailed("gap too large", {"gap": float("nan")})
    specs = [runner.PhaseSpec("pre", phase("pre", 5, {"x": 1.5}), 10, "pre things"),
             runner.PhaseSpec("bad", phase("bad", 10, error=failure), 10, "bad things"),
             runner.PhaseSpec("unselected", phase("unselected", 1), 1, "u things"),
             runner.PhaseSpec("huge", phase("huge", 1), 1000, "h things"),
             runner.PhaseSpec("crash", phase("crash", 0, error=RuntimeError("boom")), 1, "c things"),
             runner.PhaseSpec("run1", phase("run1", 50, {}), 10, "r1 things", group="run"),
             runner.PhaseSpec("run2", phase("run2", 1, {}), 10, "r2 things", group="run")]
    selected = ["pre", "bad", "huge", "crash", "run1", "run2"]
    results = runner.run_phases(specs, selected, 100.0, path, {"mode": "test"}, lambda r: ["machine note"],
                                clock=lambda: now[0], unselected="not in --phases (GPU_CHECK_PHASES)")
    assert [c[0] for c in calls] == ["pre", "bad", "crash", "run1"]  # huge and run2 never started
    # timeout 3 x estimate 10; the phases left out by --phases are known as skipped from the start
    assert calls[0] == ("pre", 30.0, "pre", {s.name: "skipped" if s.name == "unselected" else "not_run" for s in specs})
    assert calls[1][2] == "bad" and calls[1][3]["pre"] == "ok"  # written after pre, before bad
    assert calls[3][1] == 30.0  # min(budget left 85, 3 x estimate 10)
    disk = on_disk()
    assert runner.json_safe(results) == disk
    status = {n: (p["status"], p.get("why") or p.get("reason")) for n, p in disk["phases"].items()}
    assert status["pre"] == ("ok", None) and disk["phases"]["pre"]["measurements"] == {"x": 1.5}
    assert status["bad"] == ("failed", "gap too large") and disk["phases"]["bad"]["measurements"] == {"gap": "nan"}
    assert status["unselected"] == ("skipped", "not in --phases (GPU_CHECK_PHASES)")
    assert status["huge"][0] == "skipped" and "needs ~1000 s" in status["huge"][1]
    assert status["crash"] == ("failed", "RuntimeError: boom")
    assert status["run2"][0] == "skipped" and "needs ~50 s" in status["run2"][1]  # run1 took 50 s; 35 s left
    assert disk["finished"] and disk["running"] is None and not disk["ok"] and results["ok"] is False
    assert disk["not_measured"][0] == "machine note"
    assert {n.split(" (")[0] for n in disk["not_measured"][1:]} == {"bad", "unselected", "huge", "crash", "run2"}
    assert os.listdir(tmp_path) == ["gpu_check.json"]  # no temp files left

    # the first phase gates the rest; an interrupt (SIGTERM -> SystemExit) is recorded, then propagates
    calls.clear()
    gated = [runner.PhaseSpec("pre", phase("pre", 1, error=runner.PhaseFailed("no CUDA")), 1, "p"),
             runner.PhaseSpec("next", phase("next", 1, {}), 1, "n")]
    assert runner.run_phases(gated, ["pre", "next"], 100.0, path, {}, clock=lambda: now[0])["ok"] is False
    assert on_disk()["phases"]["next"] == {"status": "skipped", "why": "pre did not pass", "measures": "n",
                                           "estimate_s": 1}
    killed = [runner.PhaseSpec("pre", phase("pre", 1, {}), 1, "p"),
              runner.PhaseSpec("long", phase("long", 1, error=SystemExit(143)), 1, "l"),
              runner.PhaseSpec("after", phase("after", 1, {}), 1, "a")]
    with pytest.raises(SystemExit):
        runner.run_phases(killed, ["pre", "long", "after"], 100.0, path, {}, clock=lambda: now[0])
    disk = on_disk()
    assert [p["status"] for p in disk["phases"].values()] == ["ok", "failed", "not_run"] and not disk["finished"]
    assert "interrupted" in disk["phases"]["long"]["reason"] and disk["running"] is None
    assert disk["not_measured"][-1] == "after (a): not run yet"


def test_gpu_check_json_writer_and_phase_selection(tmp_path):
    """write_json_atomic leaves the old file whole when a write fails midway; --phases / GPU_CHECK_PHASES
    pick a subset (preflight always) and name the valid phases on a typo, also through gpu_check.sh."""
    import gpu_check as gc
    from megatron_grpo.observe.phases import write_json_atomic

    path = tmp_path / "gpu_check.json"
    write_json_atomic(str(path), {"phase": "one", "x": float("inf")})
    assert json.loads(path.read_text()) == {"phase": "one", "x": "inf"}

    class Unprintable:
        def __str__(self):
            raise RuntimeError("disk full midway")

    with pytest.raises(RuntimeError, match="midway"):
        write_json_atomic(str(path), {"phase": "two", "big": list(range(5000)), "bad": Unprintable()})
    assert json.loads(path.read_text()) == {"phase": "one", "x": "inf"} and os.listdir(tmp_path) == ["gpu_check.json"]

    assert gc.parse_phases("") == list(gc.PHASES)
    assert gc.parse_phases("beta, smoke") == ["preflight", "smoke", "beta"]
    with pytest.raises(ValueError, match="unknown phase.*gamma.*valid: preflight,smoke,beta,fp8,A,shadow,fp16,B"):
        gc.parse_phases("beta,gamma")
    env = dict(os.environ, GPU_CHECK_DRY="1", PYTHON=sys.executable, GPU_CHECK_PHASES="beta,gamma",
               GPU_CHECK_WORK=str(tmp_path / "work"))
    proc = subprocess.run(["bash", "tools/cluster/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "gpu_check: FAILED" in proc.stderr
    assert "unknown phase(s) gamma" in proc.stdout + proc.stderr


def test_gpu_check_without_megatron_or_its_wheel_fails_with_a_json_naming_the_wheel(tmp_path):
    """The device's bare Python (no numpy, megatron-core, packaging or omegaconf) and no wheels carried: the shell
    stage fails before any phase, naming every missing wheel and the folder, and still leaves gpu_check.json."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    env = dict(os.environ, PYTHON=str(bare / "bin" / "python"), GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", "tools/cluster/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"megatron_core is not installed and {tmp_path}/no-wheels/megatron_core-*.whl is missing" in proc.stderr
    assert f"numpy is not installed and {tmp_path}/no-wheels/numpy-*.whl is missing" in proc.stderr  # brought too
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["ok"] is False and result["stage"] == "shell" and "megatron_core" in result["error"]
    assert "numpy" in result["error"]
    assert result["not_measured"][0].startswith("every phase: the shell stage failed")
    assert os.listdir(tmp_path / "out") == ["gpu_check.json"]


def test_gpu_check_preflight_names_each_problem(tmp_path, monkeypatch):
    """preflight in GPU mode on this CPU machine: the missing CUDA device, a failing import (with the wheels
    gpu_check.sh installed), too little disk and the absent TE are each reported by name."""
    import gpu_check
    import torch

    monkeypatch.setattr(gpu_check, "IMPORTS", ("yaml", "no_such_module_for_gpu_check"))  # megatron.core: the dry run
    monkeypatch.setattr(gpu_check, "MIN_FREE_GIB", {"gpu": 1e9, "dry": 0.0})
    monkeypatch.setenv("GPU_CHECK_INSTALLED", "omegaconf-2.4.0-py3-none-any.whl ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine with a GPU
    info = gpu_check.preflight_info(str(tmp_path), str(tmp_path), dry=False)
    problems = "\n".join(info["problems"])
    assert len(info["problems"]) == 3, problems
    assert "no CUDA device visible to torch" in problems and "GPU_CHECK_DRY=1" in problems
    assert f"GiB free in the work dir {tmp_path}" in problems
    assert "import no_such_module_for_gpu_check failed: ModuleNotFoundError" in problems
    assert "omegaconf-2.4.0-py3-none-any.whl" in problems and info["wheels_installed"] == [
        "omegaconf-2.4.0-py3-none-any.whl"]
    assert info["imports"]["yaml"]["ok"] and info["transformer_engine"]["usable"] is False
    notes = gpu_check.machine_notes("gpu")({"phases": {"preflight": {"measurements": info}}})
    assert any(n.startswith("Transformer Engine GEMMs: ") for n in notes)
    assert gpu_check.preflight_info(str(tmp_path), str(tmp_path), dry=True)["problems"] == [
        "import no_such_module_for_gpu_check failed: ModuleNotFoundError: No module named "
        "'no_such_module_for_gpu_check' (installed from ./wheels: omegaconf-2.4.0-py3-none-any.whl)"]


def test_every_sweep_grid_run_is_a_valid_recipe(tmp_path):
    """Each run of every grid loads with its recipe and overrides (unknown keys and bad values are errors), so a
    grid fails here rather than minutes into a sweep."""
    import sweep

    from megatron_grpo.config.recipe import load_recipe

    for grid, runs in sweep.GRIDS.items():
        if grid == "writeup":  # one recipe per run (recipes/grpo-qwen3-0.6b-eos-RUN.yaml), each in test_config
            continue
        for run, overrides in runs.items():
            cfg = load_recipe(os.path.join(ROOT, sweep.recipe_for(grid, run)), overrides + ["grpo.seed=3"])
            assert cfg.grpo.seed == 3, (grid, run)
    smol = sweep.GRIDS["smollm2-ab"]
    assert set(smol["B"]) - set(smol["A"]) == {"policy.precision.generation_dtype=bfloat16",
                                               "generation.parity_tolerance=0.1"}
    assert set(smol["G"]) - set(smol["B"]) == {"loss_fn.ratio=shadow"}
    assert set(smol["F"]) - set(smol["B"]) == {"loss_fn.ratio=one"}
    assert set(smol["noclip"]) - set(smol["B"]) == {"loss_fn.ratio_clip_min=10.0", "loss_fn.ratio_clip_max=10.0"}
    cfg = load_recipe(os.path.join(ROOT, sweep.recipe_for("smollm2-ab", "A")), smol["A"])
    assert cfg.logger.token_dump_steps == [2, 3]  # the write-up's step-3 dose is measured in every arm
    fp8 = {run: load_recipe(os.path.join(ROOT, sweep.recipe_for("fp8-dose", run)), o)
           for run, o in sweep.GRIDS["fp8-dose"].items()}
    for run, c in fp8.items():  # every arm: the bf16 trainer, the megatron generator, one step of lag
        assert (c.policy.precision.compute_dtype, c.generation.backend, c.generation.max_staleness) == (
            "bfloat16", "megatron", 1), run
    assert [(c.policy.precision.generation_dtype, c.policy.precision.shadow_dtype, c.loss_fn.ratio,
             c.loss_fn.correction) for c in fp8.values()] == [
        ("bfloat16", "bfloat16", "train", None), ("fp8", "fp8", "train", None), ("fp8", "fp8", "shadow", None),
        ("fp8", "fp8", "train", "tis")]


def test_bench_weight_sync_fp8_delta_side_by_side(tiny_dense, megatron_single):
    """``bench_weight_sync.py --fp8-delta``: per lr, bf16 and fp8 generation push the same weights; every delta
    push rebuilds the dense one bit for bit; fp8's dense push is its 1 B values + scales + bf16 rest, and one
    AdamW step changes fewer e4m3 values than bf16 values (the coarser grid)."""
    from bench_weight_sync import bench_fp8_delta

    from megatron_grpo.models import build_from_hf
    from megatron_grpo.models.fp8 import Fp8Recipe
    from tests.test_fp8_push import reference_push

    model, shape = build_from_hf(tiny_dense)
    rows = bench_fp8_delta(model, shape, [1e-5], pushes=1, bucket_mb=0.25, block=32)
    (lr, bf16, dense16, sent16, _, exact16, shares16), (_, fp8, dense8, sent8, _, exact8, shares8) = rows
    assert (lr, bf16, fp8) == (1e-5, "bf16", "fp8") and exact16 and exact8
    pushed = reference_push(tiny_dense, Fp8Recipe((32, 32), 32))
    assert dense8 < dense16 and sent8 < dense8 and sent16 < dense16
    assert dense8 == sum(t.numel() * t.element_size() for t in pushed.values())
    assert shares16["e4m3"] is None and 0 < shares8["e4m3"] < shares16["bf16"] < 1 and 0 <= shares8["scales"] < 1


FAKE_TRAIN = r'''
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
log, ckpt, steps = args["logger.log_dir"], args["checkpointing.checkpoint_dir"], int(args["grpo.max_num_steps"])
start = int(open(os.path.join(ckpt, "step")).read()) if os.path.isfile(os.path.join(ckpt, "step")) else 0
assert args["checkpointing.resume"] == "true" and args["checkpointing.save_period"] == "1"
print("launch at", start)
for step in range(start + 1, steps + 1):
    with open(os.path.join(log, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "reward/mean": -float(step)}) + "\n")
    os.makedirs(ckpt, exist_ok=True)
    open(os.path.join(ckpt, "step"), "w").write(str(step))
    if step == 2 and start == 0:
        sys.exit(137)  # killed after step 2's save
'''


def test_study_runs_save_every_step_and_go_on_from_their_last_step(tmp_path):
    """A study run (``train_command(..., checkpoint_every_step=True)``) stopped mid-way resumes from its last saved
    step, keeps its first launch's log and wall time, and drops its checkpoints once complete."""
    from megatron_grpo.observe import experiments

    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    log_dir = str(tmp_path / "B8" / "seed0")
    cmd = experiments.train_command("r.yaml", ["loss_fn.ratio=train"], 0, log_dir, 4, 1, checkpoint_every_step=True)
    assert f"checkpointing.checkpoint_dir={os.path.join(log_dir, 'ckpt')}" in cmd
    cmd = [sys.executable, str(fake)] + cmd[cmd.index("train") + 2:]
    assert not experiments.run_one(cmd, log_dir, 4)  # killed after step 2
    assert [r["step"] for r in experiments.read_rows(log_dir)] == [1, 2] and os.path.isdir(os.path.join(log_dir, "ckpt"))
    assert experiments.run_one(cmd, log_dir, 4)
    assert [r["step"] for r in experiments.read_rows(log_dir)] == [1, 2, 3, 4]
    assert open(os.path.join(log_dir, "train.log")).read().split() == ["launch", "at", "0", "launch", "at", "2"]
    state = json.load(open(os.path.join(log_dir, "process.json")))
    assert state["launches"] == 2 and state["returncode"] == 0 and state["process_wall_s"] > 0
    assert state["cpus"] == [experiments.cpu_description()] * 2 and "[" in state["cpus"][0]
    assert not os.path.exists(os.path.join(log_dir, "ckpt"))  # complete: the resume point is gone, the metrics stay
    assert experiments.run_one(cmd, log_dir, 4)  # complete: not re-run
    assert json.load(open(os.path.join(log_dir, "process.json")))["launches"] == 2
