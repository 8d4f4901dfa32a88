"""The diagnostics sub-commands (doctor, plot, report) on recorded files, the quiet filters, the
optional W&B / MLflow loggers (skipped without the packages) and the quiet main command end to end."""

import json
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_grpo.observe import quiet
from megatron_grpo.cli import main
from tests.test_doctor import precision_config, step_row, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(step, **kw):
    row = step_row(step, **kw)
    row.update({"timing/generate_s": 1.0, "timing/reward_s": 0.01, "timing/train_s": 2.0,
                "timing/weight_push_s": 0.5, "timing/parity_s": 0.2})
    return row


@pytest.fixture
def two_runs(tmp_path):
    matched = write_run(tmp_path / "sweep" / "A-bf16" / "seed0", [timed(s) for s in range(1, 7)],
                        precision_config("bfloat16", "bfloat16"))
    mismatch = write_run(tmp_path / "sweep" / "B-fp32" / "seed0",
                         [timed(s, beta=0.07, phantom=0.15) for s in range(1, 7)],
                         precision_config("float32", "bfloat16"))
    return matched, mismatch


def test_doctor_command_exit_code_and_verdict(two_runs, capsys, monkeypatch):
    matched, mismatch = two_runs
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main(["doctor", matched]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # every command: idle OpenMP threads sleep (cli.main)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main(["doctor", matched]) == 0 and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # a user's setting stays
    assert "healthy" in capsys.readouterr().out
    assert main(["doctor", mismatch]) == 1
    out = capsys.readouterr().out
    assert "phantom clipping zeroes 15.0%" in out and "loss_fn.ratio=shadow" in out
    assert main(["doctor", os.path.dirname(matched)]) == 2  # not a run dir: named, no traceback
    assert "no metrics.jsonl" in capsys.readouterr().out


def test_plot_command_writes_the_first_figures(two_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "figs")
    assert main(["plot", *two_runs, "--out", out]) == 0
    names = set(os.listdir(out))
    assert {"reward.png", "beta_by_rarity.png", "clip_fractions.png", "deployed_improvement.png",
            "timing.png"} <= names
    from megatron_grpo.observe.plots import load_runs, timing_figure

    fig = timing_figure(load_runs(list(two_runs)))
    assert [round(p.get_height(), 3) for p in fig.axes[0].patches][:5] == [1.0, 0.01, 2.0, 0.5, 0.2]


def test_plots_of_sampled_diagnostics_join_the_sampled_steps(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_grpo.observe.plots import clip_figure, line_figure, load_runs, make_figures
    from tests.test_doctor import sampled_rows

    run = write_run(tmp_path / "sampled", sampled_rows(n=10, every=2), precision_config("float32", "bfloat16"))
    runs = load_runs([run])
    line = line_figure(runs, "precision/beta_abs_mean", "beta").axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [1, 2, 4, 6, 8, 10] and line.get_marker() == "o"
    assert line.get_label() == "sampled (6 of 10 steps sampled)"
    reward = line_figure(runs, "reward/mean", "reward").axes[0].get_lines()[0]  # logged every step
    assert len(reward.get_xdata()) == 10 and reward.get_label() == "sampled"
    assert clip_figure(runs).axes[0].get_lines()[0].get_label() == "phantom (6 of 10 steps sampled)"
    assert len(make_figures([run], str(tmp_path / "figs"))) >= 8


def test_report_command(two_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    sweep = str(tmp_path / "sweep")
    assert main(["report", sweep, "--html"]) == 0
    text = open(os.path.join(sweep, "report.md")).read()
    assert "figures/reward.png" in text and "figures/timing.png" in text
    assert os.path.isfile(os.path.join(sweep, "report.html"))


@pytest.fixture
def quiet_installed(monkeypatch):
    """quiet.install() for one test; log levels, filters, warning filters and env restored after."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    levels = {name: logging.getLogger(name).level for name in ("", "megatron_grpo")}
    with warnings.catch_warnings():
        quiet.install()
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    for name in quiet.HARMLESS_LOGS:
        target = logging.getLogger(name)
        for f in [f for f in target.filters if isinstance(f, quiet.DropHarmless)]:
            target.removeFilter(f)


def test_harmless_messages_are_dropped_and_real_ones_kept(quiet_installed):
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    layerwise.addHandler(handler)
    try:
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure still shows
    finally:
        layerwise.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["QKVParallelLinear: Failed to load weights"]
    gpt = logging.getLogger("megatron.core.models.gpt.gpt_model")  # Megatron-Core 0.19, docs/megatron-versions.md
    drop_gpt = next(f for f in gpt.filters if isinstance(f, quiet.DropHarmless))
    assert not drop_gpt.filter(logging.LogRecord(gpt.name, logging.WARNING, "", 0, "GPTModel IS DEPRECATED. GPTModel "
                                                 "is only accepting critical bug fixes", (), None))
    assert drop_gpt.filter(logging.LogRecord(gpt.name, logging.WARNING, "", 0, "something real", (), None))
    base = logging.getLogger("vllm.renderers.base")
    drop = next(f for f in base.filters if isinstance(f, quiet.DropHarmless))
    no_tokenizer = logging.LogRecord("vllm.renderers.base", logging.WARNING, "", 0, "Chat template warmup failed",
                                     (), (ValueError, ValueError(quiet._NO_TOKENIZER), None))
    other = logging.LogRecord("vllm.renderers.base", logging.WARNING, "", 0, "Chat template warmup failed",
                              (), (KeyError, KeyError("x"), None))
    assert not drop.filter(no_tokenizer) and drop.filter(other)
    assert logging.getLogger("megatron_grpo").isEnabledFor(logging.INFO)
    assert not logging.getLogger("megatron.core").isEnabledFor(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet.install()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("something real", UserWarning)
    assert [str(w.message) for w in caught] == ["something real"]


def test_verbose_installs_no_filter_and_reaches_the_generator(monkeypatch):
    monkeypatch.setenv(quiet.VERBOSE_ENV, "0")  # recorded, so the test's "1" is undone after it
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    level = logging.getLogger().level
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    before = list(layerwise.filters)
    try:
        with warnings.catch_warnings():
            quiet.install(verbose=True)
        assert quiet.is_verbose() and os.environ["VLLM_LOGGING_LEVEL"] == "INFO"  # inherited by the generator
        assert layerwise.filters == before and logging.getLogger().level == logging.INFO
    finally:
        logging.getLogger().setLevel(level)
    from megatron_grpo.cli import build_parser

    assert build_parser().parse_args(["train", "r.yaml", "--verbose"]).verbose


def _tracker_logger(tmp_path, **logger_keys):
    from megatron_grpo.config.schema import Config, from_dict, to_dict
    from megatron_grpo.observe.metrics_logger import MetricsLogger, build_trackers

    cfg = from_dict(Config, {"logger": {"log_dir": str(tmp_path), **logger_keys}})
    trackers = build_trackers(cfg.logger, to_dict(cfg))
    return MetricsLogger(str(tmp_path), enabled=True, tensorboard=False, progress_bar=False, total_steps=2,
                         trackers=trackers), trackers


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lg, trackers = _tracker_logger(tmp_path, wandb_enabled=True, wandb={"project": "t", "mode": "offline"})
    for step in (1, 2):
        lg.log(step, {"reward/mean": -float(step), "precision/snr": float("nan")})
    lg.close()
    assert len(trackers) == 1 and os.path.isdir(tmp_path / "wandb")


def test_mlflow_file_store_run(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    lg, (tracker,) = _tracker_logger(tmp_path, mlflow_enabled=True, mlflow={"experiment_name": "t"})
    for step in (1, 2):
        lg.log(step, {"reward/mean": -float(step), "precision/snr": float("nan")})
    lg.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    history = client.get_metric_history(tracker.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, -1.0), (2, -2.0)]
    assert client.get_run(tracker.run_id).data.params["loss_fn.ratio"] == "train"


def test_missing_tracker_package_names_the_key_and_extra(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    with pytest.raises(ValueError, match=r"logger.wandb_enabled=true needs the wandb package: pip install '\.\[wandb\]'"):
        _tracker_logger(tmp_path, wandb_enabled=True)


PROGRESS = re.compile(r"\d+%\|")


def output_lines(text: str):
    """Lines a person reads: tqdm redraws (split on carriage returns) and blank lines left out."""
    parts = [p for line in text.split("\n") for p in line.split("\r")]
    return [p for p in parts if p.strip() and not PROGRESS.search(p)]


@pytest.mark.vllm
def test_main_command_is_quiet_and_ends_with_a_summary(tmp_path, tiny_dense):
    """The README's main command, shortened (3 steps, smaller batch), with its progress bar."""
    log_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "megatron_grpo", "train", "recipes/grpo-tiny-eos-cpu.yaml", "grpo.max_num_steps=3",
           "grpo.num_prompts_per_step=2", f"policy.model_name={tiny_dense}", f"logger.log_dir={log_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = output_lines(out)
    assert len(lines) <= 40, "\n".join(lines)
    assert "Traceback" not in out and "Failed to load weights" not in out
    assert "run summary" in out and "healthy" in out
    summary = json.load(open(os.path.join(log_dir, "summary.json")))
    assert summary["steps"] == 3 and summary["healthy"]
    assert os.path.isfile(os.path.join(log_dir, "config.yaml"))
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    for phase in ("generate", "reward", "train", "weight_push", "parity"):
        assert all(r[f"timing/{phase}_s"] >= 0 for r in rows), phase
    assert rows[-1]["timing/train_s"] > 0 and rows[-1]["timing/parity_s"] > 0
