"""Checkpoints and faults: exact resume after SIGKILL, TP re-layout, corrupt files, generator crash, NaN."""

import json
import os

import pytest

from megatron_grpo import checkpoint as ckpt
from tests.test_train import run_cli

pytestmark = pytest.mark.vllm
VOLATILE = ("time/", "sync/push_s")


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_sigkill_between_steps_then_resume_reproduces_metrics_exactly(tmp_path, tiny_dense):
    common = [f"policy.model_name={tiny_dense}", "grpo.max_num_steps=6", "checkpointing.save_period=1"]
    code, out, straight = run_cli(common + [f"checkpointing.checkpoint_dir={tmp_path / 'ck-a'}"], str(tmp_path / "a"))
    assert code == 0, out[-3000:]
    run_b = common + [f"checkpointing.checkpoint_dir={tmp_path / 'ck-b'}"]
    os.environ["MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"] = "3"
    try:
        code, _, killed = run_cli(run_b, str(tmp_path / "b"))
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"]
    assert code == -9 and [r["step"] for r in killed] == [1, 2, 3]
    code, out, resumed = run_cli(run_b + ["checkpointing.resume=true"], str(tmp_path / "b"))
    assert code == 0, out[-3000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # each step once
    for a, b in zip(straight, resumed):
        assert _stable(a) == _stable(b), a["step"]
    for step in ckpt.list_checkpoints(str(tmp_path / "ck-b")):
        ckpt.verify(ckpt.step_dir(str(tmp_path / "ck-b"), step))


@pytest.mark.parametrize("save_tp, resume_tp", [(2, 1), (1, 2)])
def test_resume_at_another_tensor_parallel_layout(save_tp, resume_tp, tmp_path, tiny_dense):
    common = [f"policy.model_name={tiny_dense}", f"checkpointing.checkpoint_dir={tmp_path / 'ck'}"]
    code, out, ref = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=2"], str(tmp_path / "ref"))
    assert code == 0, out[-3000:]
    tp = lambda n: [f"policy.megatron_cfg.tensor_model_parallel_size={n}"]  # noqa: E731
    code, out, _ = run_cli(common + ["grpo.max_num_steps=1"] + tp(save_tp), str(tmp_path / "run"), nproc=save_tp)
    assert code == 0, out[-3000:]
    code, out, rows = run_cli(common + ["grpo.max_num_steps=2", "checkpointing.resume=true"] + tp(resume_tp),
                              str(tmp_path / "run"), nproc=resume_tp)
    assert code == 0, out[-3000:]
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("loss/policy", "reward/mean", "train/grad_norm", "policy/kl_rollout"):
        assert rows[1][name] == pytest.approx(ref[1][name], abs=1e-5, rel=1e-4), name


def _fake_checkpoint(root, step):
    tmp = os.path.join(root, f".tmp{step}")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
        f.write(os.urandom(4096))
    return ckpt.finalize_dir(tmp, root, step, keep_last_n=2)


def test_truncated_checkpoint_is_detected_and_fallback_uses_previous(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        _fake_checkpoint(root, step)
    assert ckpt.list_checkpoints(root) == [2, 3]  # keep_last_n
    assert ckpt.latest_step(root) == 3
    victim = os.path.join(ckpt.step_dir(root, 3), "model.safetensors")
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ckpt.CheckpointError, match=victim.replace("/", ".")[:0] + "truncated") as err:
        ckpt.resolve_for_load(root, fallback_to_previous=False)
    assert victim in str(err.value) and "fallback_to_previous" in str(err.value)
    assert ckpt.resolve_for_load(root, fallback_to_previous=True) == ckpt.step_dir(root, 2)
    with open(os.path.join(ckpt.step_dir(root, 2), "model.safetensors"), "r+b") as f:
        f.write(b"corrupt!")
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        ckpt.resolve_for_load(root, fallback_to_previous=True)
    os.makedirs(os.path.join(root, "step_0000009"))  # a partial folder without manifest
    assert ckpt.list_checkpoints(root)[-1] == 9
    with pytest.raises(ckpt.CheckpointError, match="partial"):
        ckpt.verify(ckpt.step_dir(root, 9))


@pytest.mark.parametrize("backend", ["vllm", "vllm_server"])
def test_generator_killed_mid_run_recovers_without_corrupting_checkpoints(backend, tmp_path, tiny_dense):
    os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP"] = "2"
    try:
        code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=3",
                                   f"generation.backend={backend}", "generation.retry_timeout_s=5",
                                   "checkpointing.save_period=1", f"checkpointing.checkpoint_dir={tmp_path / 'ck'}"],
                                  str(tmp_path / "run"))
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP"]
    assert code == 0, out[-3000:]
    assert "restarting it" in out and [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["sync/logprob_abs_diff_mean"] for r in rows) < 1e-4  # re-pushed weights match
    for step in ckpt.list_checkpoints(str(tmp_path / "ck")):
        ckpt.verify(ckpt.step_dir(str(tmp_path / "ck"), step))


def test_nan_log_probs_skip_the_step_and_repeated_nans_stop_the_run(tmp_path, tiny_dense):
    os.environ["MEGATRON_GRPO_FAULT_NAN_STEP"] = "2"
    try:
        code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=3"], str(tmp_path / "a"))
        assert code == 0, out[-3000:]
        assert [r["train/skipped_nonfinite"] for r in rows] == [0.0, 1.0, 0.0]
        assert "log_probs of micro-batch 0: 1 non-finite" in out
        code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=3",
                                   "grpo.max_consecutive_skips=1"], str(tmp_path / "b"))
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_NAN_STEP"]
    assert code != 0 and "step 2: log_probs of micro-batch 0" in out


# ---- expert-parallel checkpoints: the same files from EP=1 and EP=2, loadable at either ---------------


def _fake_trainer(st, shape, checkpoint_dir):
    from types import SimpleNamespace as NS

    import torch.distributed as dist

    ctx = NS(rank=dist.get_rank(), optimizer=st.optimizer, model=st.model, shape=shape, sampler=NS(position=0))
    return NS(ctx=ctx, cfg=NS(checkpointing=NS(checkpoint_dir=checkpoint_dir, keep_last_n=2)), step=1, version=1,
              gate=NS(dropped=0), consecutive_skips=0)


def _ep_checkpoint_worker(model_dir, ep, save_dir=None, load_from=None):
    """EP=ep, DP=ep: one optimizer step on this rank's rows then a save, or a load of ``load_from``
    then a save; returns nothing (the files are the result)."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_grpo import resume
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.parallel import state
    from tests.test_routing import ROWS, SEQ, _step_batch, _stepper

    state.initialize_model_parallel(state.Layout(world_size=ep, ep=ep))
    st = _stepper(model_dir)
    trainer = _fake_trainer(st, shape_from_hf(load_hf_config(model_dir)), save_dir)
    if load_from:
        resume.load_checkpoint(trainer, load_from)
    else:
        st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        st.current_step, st.nonfinite = 0, []
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        old, adv = torch.full((ROWS, SEQ), -7.0), torch.linspace(-1.0, 1.0, ROWS)
        st.optimizer.zero_grad()
        st.forward_backward(_step_batch(old, adv, rows=slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)), None, None)
        st.optimizer.step()
    resume.save_checkpoint(trainer)


def _checkpoint_tensors(root):
    from safetensors.torch import load_file

    path = ckpt.step_dir(root, 1)
    ckpt.verify(path)
    return {f: load_file(os.path.join(path, f)) for f in (ckpt.MODEL_FILE, ckpt.EXP_AVG_FILE, ckpt.EXP_AVG_SQ_FILE)}


def test_expert_parallel_checkpoint_matches_ep1_and_reloads_at_another_layout(tmp_path, tiny_moe):
    import torch

    from tests._dist import run_distributed

    for ep in (1, 2):
        run_distributed(_ep_checkpoint_worker, ep, tiny_moe, ep, str(tmp_path / f"ep{ep}"))
    ep1, ep2 = _checkpoint_tensors(str(tmp_path / "ep1")), _checkpoint_tensors(str(tmp_path / "ep2"))
    # fp32 reduction-order noise in tiny gradients moves Adam's first, sign-like step (lr 2e-3) by < 1e-5
    tolerance = {ckpt.MODEL_FILE: dict(rtol=0, atol=1e-5), ckpt.EXP_AVG_FILE: dict(rtol=1e-4, atol=1e-10),
                 ckpt.EXP_AVG_SQ_FILE: dict(rtol=1e-4, atol=1e-14)}
    for filename, tensors in ep1.items():
        assert set(ep2[filename]) == set(tensors)
        for name, t in tensors.items():
            torch.testing.assert_close(ep2[filename][name], t, **tolerance[filename],
                                       msg=lambda m: f"{filename}: {name}: {m}")
    # the EP=1 checkpoint loaded at EP=2 and saved again: the same bytes' worth of tensors
    run_distributed(_ep_checkpoint_worker, 2, tiny_moe, 2, str(tmp_path / "again"), ckpt.step_dir(str(tmp_path / "ep1"), 1))
    again = _checkpoint_tensors(str(tmp_path / "again"))
    for filename, tensors in ep1.items():
        for name, t in tensors.items():
            assert torch.equal(again[filename][name], t), (filename, name)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_tampered_trainer_state_cannot_run_code_on_resume(tmp_path):
    """``trainer_state.pt`` is unpickled with weights_only=True: a crafted pickle is refused (a
    CheckpointError naming the file) and its payload never runs."""
    import torch

    from megatron_grpo.resume import read_trainer_state

    marker = tmp_path / "pwned"
    torch.save({"step": 1, "payload": _Exploit(str(marker))}, tmp_path / ckpt.STATE_FILE)
    with pytest.raises(ckpt.CheckpointError, match=ckpt.STATE_FILE):
        read_trainer_state(str(tmp_path))
    assert not marker.exists()
    torch.save({"step": 3, "rng": [{"torch": torch.get_rng_state()}], "parity": {"sequences": [[1, 2]],
                "prompt_lens": [1], "baseline": {"sync/logprob_abs_diff_mean": 1e-7}}}, tmp_path / ckpt.STATE_FILE)
    assert read_trainer_state(str(tmp_path))["step"] == 3  # what the trainer saves loads as plain data
