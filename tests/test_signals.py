"""Preemption under torchrun: SIGTERM to one rank stops every rank at the same step boundary, with one
checkpoint of that step, and a distinct exit status. The real ``GRPOTrainer.train`` loop runs on two
gloo ranks around a stubbed step; ``save`` is collective, as the real one is."""

import os
import signal
import time

from tests._dist import run_distributed


def _rank_main(log_dir, max_steps, signal_rank, signal_step):
    import torch
    import torch.distributed as dist

    from megatron_grpo.config.schema import Config, to_dict
    from megatron_grpo.observe.doctor import LiveDoctor
    from megatron_grpo.observe.metrics_logger import MetricsLogger
    from megatron_grpo.parallel import state
    from megatron_grpo.trainer.loop import GRPOTrainer

    state.init_distributed()
    rank = dist.get_rank()

    class Trainer(GRPOTrainer):
        def __init__(self):
            self._started, self.step, self.consecutive_skips, self.saved = time.perf_counter(), 0, 0, []
            self._stop_requested = False
            self.cfg = Config()
            self.cfg.grpo.max_num_steps = max_steps
            self.cfg.logger.log_dir = log_dir
            self.cfg.checkpointing.checkpoint_dir = os.path.join(log_dir, "ckpt")
            self.cfg.checkpointing.save_period = 5
            self.ctx = type("Ctx", (), {"rank": rank, "engine": None, "device": torch.device("cpu")})()
            self.logger = MetricsLogger(log_dir, enabled=rank == 0, tensorboard=False, progress_bar=False,
                                        total_steps=max_steps)
            self.doctor = LiveDoctor(to_dict(self.cfg))

        def check_parity(self, force=False):
            return {}

        def train_step(self):
            if rank == signal_rank and self.step + 1 == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)  # lands mid-step, on this rank only
            dist.barrier()  # the step's own collectives
            return {"reward/mean": float(self.step)}

        def save(self):  # collective like the real one: both ranks must save the same step
            steps = [None, None]
            dist.all_gather_object(steps, self.step)
            assert steps[0] == steps[1], f"ranks saved different steps: {steps}"
            self.saved.append(self.step)

    trainer = Trainer()
    code = trainer.train()
    return code, trainer.step, trainer.saved


def test_sigterm_to_one_rank_stops_both_at_one_boundary_with_a_checkpoint(tmp_path):
    results = run_distributed(_rank_main, 2, str(tmp_path), 10, 1, 3, timeout=300)
    # both ranks stop after step 3, save it once, and exit with the preemption status
    assert results == [(75, 3, [3]), (75, 3, [3])]


def test_a_full_run_saves_its_last_step_once_and_exits_0(tmp_path):
    results = run_distributed(_rank_main, 2, str(tmp_path), 5, 0, 0, timeout=300)
    assert results == [(0, 5, [5]), (0, 5, [5])]  # no signal: the periodic save at 5 is also the final one


def test_generator_process_leaves_the_trainers_process_group():
    """A SIGTERM to the trainer's process group (Slurm's preemption) must not reach the generator:
    the generator process makes its own group first thing (and still dies with its parent)."""
    import subprocess
    import sys

    code = ("import os\n"
            "from megatron_grpo.rollout.engines import vllm_worker\n"
            "before = os.getpgid(0)\n"
            "vllm_worker._die_with_parent()\n"
            "print(before != os.getpgid(0), os.getpgid(0) == os.getpid())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_server_log_lives_in_the_run_log_dir(tmp_path, monkeypatch):
    from megatron_grpo.trainer import build as setup
    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.rollout import ROLLOUT_ENGINES
    from tests.test_train import RECIPE

    seen = {}
    monkeypatch.setattr(ROLLOUT_ENGINES, "get", lambda name: lambda *a, **kw: seen.update(kw))
    cfg = load_recipe(RECIPE, ["generation.backend=vllm_server", f"logger.log_dir={tmp_path}"])
    setup._build_engine(cfg, "model", type("Shape", (), {"is_moe": False})())
    assert seen["log_path"] == os.path.join(str(tmp_path), "vllm-server.log")
