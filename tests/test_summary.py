"""The end-of-run summary: numbers from metrics.jsonl rows, summary.json, and the real training loop
(with a stubbed step) writing it after a normal end, after SIGTERM and after an error."""

import json
import math
import os
import signal
import time

import pytest

from megatron_grpo.config.schema import Config, to_dict
from megatron_grpo.observe.summary import format_summary, summarize, write_summary
from tests.test_doctor import fp8_config, precision_config, step_row, write_run


def timed_row(step, **kw):
    row = step_row(step, **kw)
    row.update({"timing/generate_s": 1.0, "timing/reward_s": 0.01, "timing/train_s": 2.0,
                "timing/weight_push_s": 0.5, "timing/parity_s": 0.25, "time/step_s": 3.8})
    return row


def test_summary_numbers_come_from_the_rows(tmp_path):
    rows = [timed_row(s, beta=0.01 * s, phantom=0.02 * s) for s in range(1, 11)]
    rows[6]["reward/mean"] = 5.0  # the best step
    config = precision_config("float32", "bfloat16")
    config["checkpointing"]["checkpoint_dir"] = str(tmp_path / "ckpt")
    log_dir = write_run(tmp_path / "run", rows, config)
    s = write_summary(log_dir, config, wall_s=60.0, planned_steps=10)
    assert s == json.loads(open(os.path.join(log_dir, "summary.json")).read())
    assert s["steps"] == 10 and s["stopped"] is None and s["wall_s"] == 60.0
    assert s["timing_s"] == pytest.approx({"generate": 10.0, "reward": 0.1, "train": 20.0, "weight_push": 5.0,
                                           "parity": 2.5})
    assert s["reward"] == {"first": -15.0, "last": -6.0, "best": 5.0}
    assert s["completion_length"] == {"first": 15.5, "last": 11.0}
    assert s["beta_abs_mean"]["first"] == pytest.approx(0.03) and s["beta_abs_mean"]["last"] == pytest.approx(0.08)
    assert s["phantom_zero_grad_fraction"]["first"] == pytest.approx(0.06)
    assert s["deployed_improvement_mean"] == pytest.approx(1e-3)
    assert not s["healthy"] and "phantom clipping zeroes" in s["doctor"]
    assert s["paths"]["checkpoints"] == str(tmp_path / "ckpt") and s["paths"]["tensorboard"] is None  # no events
    assert s["commands"]["resume"].endswith("config.yaml checkpointing.resume=true")
    assert s["commands"]["plot"].startswith(f"megatron-grpo plot {log_dir}")
    text = format_summary(s)
    assert "steps 10/10; wall time 60.0s (generate 10.0s, reward 0.1s, train 20.0s" in text
    assert "reward: first -15.000, last -6.000, best 5.000" in text
    assert f"megatron-grpo doctor {log_dir}" in text and len(text.splitlines()) <= 25


def test_summary_of_an_empty_run_and_nan_values(tmp_path):
    s = summarize([], None, wall_s=float("nan"), planned_steps=5, stopped="error")
    assert s["steps"] == 0 and s["reward"]["best"] is None and s["wall_s"] is None
    json.dumps(s, allow_nan=False)  # valid JSON: no NaN anywhere
    rows = [{"step": 1, "reward/mean": math.nan, "precision/beta_abs_mean": 0.0}]
    s = summarize(rows, None)
    assert s["reward"]["first"] is None and s["beta_abs_mean"]["first"] == 0.0
    json.dumps(s, allow_nan=False)


def test_summary_of_sampled_diagnostics_says_how_many_steps_were_sampled(tmp_path):
    from tests.test_doctor import sampled_rows

    rows = sampled_rows(n=10, every=3)  # steps 1, 3, 6, 9 carry the diagnostics
    s = summarize(rows, precision_config("float32", "bfloat16"))
    assert s["diagnostics_steps"] == {"precision": 4, "deployed_improvement": 4}
    assert s["beta_abs_mean"]["first"] == pytest.approx(0.02 * (1 + 3 + 6 + 9) / 4)  # the 4 sampled steps
    assert s["deployed_improvement_mean"] == pytest.approx(1e-3)
    json.dumps(s, allow_nan=False)
    text = format_summary({**s, "paths": {}, "commands": {}})
    assert "first -> last 5 sampled steps (4 of 10 steps sampled): mean |beta| 9.50e-02 -> 9.50e-02" in text
    assert "deployed improvement (mean per step (4 of 10 steps sampled)): 1.00e-03" in text


class StubTrainer:
    """The real ``GRPOTrainer.train`` loop around a stubbed step (no model, no generator)."""

    @staticmethod
    def make(tmp_path, max_steps, signal_at=None, fail_at=None):
        from megatron_grpo.observe.doctor import LiveDoctor
        from megatron_grpo.observe.metrics_logger import MetricsLogger
        from megatron_grpo.trainer.loop import GRPOTrainer

        class Trainer(GRPOTrainer):
            def __init__(self):
                self._started, self.step, self.consecutive_skips = time.perf_counter(), 0, 0
                self._stop_requested = False
                self.cfg = Config()
                self.cfg.grpo.max_num_steps = max_steps
                self.cfg.logger.log_dir = str(tmp_path / "run")
                self.ctx = type("Ctx", (), {"rank": 0, "engine": None})()
                self.logger = MetricsLogger(self.cfg.logger.log_dir, enabled=True, tensorboard=False,
                                            progress_bar=False, total_steps=max_steps)
                self.doctor = LiveDoctor(to_dict(self.cfg))

            def check_parity(self, force=False):
                return {}

            def stop_requested(self):
                return self._stop_requested

            def train_step(self):
                if self.step + 1 == signal_at:
                    os.kill(os.getpid(), signal.SIGTERM)
                if self.step + 1 == fail_at:
                    raise RuntimeError("boom")
                return timed_row(self.step + 1)

        return Trainer()


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_summary_after_a_normal_end(tmp_path, capsys, restore_signals):
    StubTrainer.make(tmp_path, max_steps=4).train()
    s = json.load(open(tmp_path / "run" / "summary.json"))
    assert s["steps"] == 4 and s["planned_steps"] == 4 and s["stopped"] is None and s["healthy"]
    assert "run summary" in capsys.readouterr().out


def test_summary_after_sigterm(tmp_path, capsys, restore_signals):
    StubTrainer.make(tmp_path, max_steps=10, signal_at=3).train()  # stops at the step boundary
    s = json.load(open(tmp_path / "run" / "summary.json"))
    assert s["steps"] == 3 and s["planned_steps"] == 10 and s["stopped"] == "signal"
    out = capsys.readouterr().out
    assert "steps 3/10, stopped early (signal)" in out


def test_summary_after_an_error_does_not_hide_it(tmp_path, capsys, restore_signals):
    with pytest.raises(RuntimeError, match="boom"):
        StubTrainer.make(tmp_path, max_steps=10, fail_at=3).train()
    s = json.load(open(tmp_path / "run" / "summary.json"))
    assert s["steps"] == 2 and s["stopped"] == "error"


@pytest.mark.parametrize("fail_at", [None, 3])
def test_train_puts_back_the_signal_handlers_and_lets_the_trainer_go(tmp_path, restore_signals, fail_at):
    """Its SIGTERM/SIGINT handler is a closure over the trainer: left installed, the model, optimizer and
    their process groups would live until the interpreter exits, past ``state.shutdown``."""
    import gc
    import weakref

    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGTERM, mine)
    sigint = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN under `nohup ... &`
    trainer = StubTrainer.make(tmp_path, max_steps=4, fail_at=fail_at)
    try:
        trainer.train()
    except RuntimeError:
        assert fail_at is not None
    assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is sigint
    gone = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert gone() is None


def test_written_config_round_trips_as_a_recipe(tmp_path):
    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.trainer.build import write_config

    cfg = load_recipe(os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes", "grpo-tiny-eos-cpu.yaml"),
                      ["policy.precision.generation_dtype=bfloat16", f"logger.log_dir={tmp_path}"])
    path = write_config(cfg, str(tmp_path))
    assert to_dict(load_recipe(path)) == to_dict(cfg)


def test_summary_names_the_precisions_fp8_with_its_settings():
    rows = [{"step": s, **step_row(s, beta=0.01)} for s in range(1, 4)]
    s = summarize(rows, fp8_config(first=2, last=1))
    assert s["precision"] == ("params float32, trainer bfloat16, generator fp8, shadow fp8 (fp8: e4m3 weight blocks "
                              "[32, 32], activation groups 32, bf16 layers 2 first / 1 last, pow2 scales: none)")
    assert "\nprecision: params float32, trainer bfloat16, generator fp8" in format_summary({**s, "paths": {},
                                                                                            "commands": {}})
    plain = summarize(rows, precision_config("float32", "bfloat16"))["precision"]
    assert plain == "params float32, trainer float32, generator bfloat16, shadow bfloat16"
    assert summarize(rows, None)["precision"] is None
