"""Checkpoints and faults: exact resume after SIGKILL, TP re-layout, corrupt files, generator crash, NaN."""

import errno
import logging
import os
import shutil

import pytest

from megatron_grpo import checkpoint as ckpt
from tests.test_train import run_cli

pytestmark = pytest.mark.vllm
VOLATILE = ("time/", "timing/", "sync/push_s")


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


def _two_checkpoints(tmp_path):
    root = str(tmp_path)
    for step in (1, 2):
        _fake_checkpoint(root, step)
    return root


def _assert_error_then_fallback(root, culprit, caplog, expected=1):
    """No fallback: a CheckpointError naming ``culprit``; fallback: step ``expected``, warning why."""
    with pytest.raises(ckpt.CheckpointError, match="fallback_to_previous") as err:
        ckpt.resolve_for_load(root, fallback_to_previous=False)
    assert culprit in str(err.value)
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.checkpoint"):
        assert ckpt.resolve_for_load(root, fallback_to_previous=True) == ckpt.step_dir(root, expected)
    assert culprit in caplog.text and f"resuming from {ckpt.step_dir(root, expected)}" in caplog.text


@pytest.mark.parametrize("content, why", [
    (b"", "is empty"), (b"\n \n", "is empty"), (b"\x00\x00\x00", "not valid JSON"),
    (b'{"step": 2, "fi', "not valid JSON"),
    (b"[1, 2]", "key 'files'"), (b'{"step": 2}', "key 'files'"), (b'{"files": {}}', "key 'files'"),
    (b'{"files": {"model.safetensors": {"bytes": 4096}}}', "key 'files.model.safetensors'"),
    (b'{"files": {"../latest": {"bytes": 1, "sha256": "' + b"0" * 64 + b'"}}}', "is not a file name")])
def test_broken_manifest_is_a_checkpoint_error_naming_it_and_fallback_covers_it(tmp_path, caplog, content, why):
    root = _two_checkpoints(tmp_path)
    manifest = os.path.join(ckpt.step_dir(root, 2), ckpt.MANIFEST)
    with open(manifest, "wb") as f:
        f.write(content)
    with pytest.raises(ckpt.CheckpointError, match=why):
        ckpt.verify(ckpt.step_dir(root, 2))
    _assert_error_then_fallback(root, manifest, caplog)


@pytest.mark.parametrize("content, why", [(b"", "is empty"), (b"\n", "is empty"), (b"step_2", "not hold a step"),
                                          (b"-1", "not hold a step"), (b"\xff\xfe", "not hold a step")])
def test_broken_latest_pointer_is_a_checkpoint_error_naming_it_and_fallback_uses_newest_intact(
        tmp_path, caplog, content, why):
    root = _two_checkpoints(tmp_path)
    pointer = os.path.join(root, "latest")
    with open(pointer, "wb") as f:
        f.write(content)
    with pytest.raises(ckpt.CheckpointError, match=why):
        ckpt.latest_step(root)
    _assert_error_then_fallback(root, pointer, caplog, expected=2)


def test_latest_naming_a_deleted_folder_is_an_error_not_a_silent_older_resume(tmp_path, caplog):
    root = _two_checkpoints(tmp_path)
    shutil.rmtree(ckpt.step_dir(root, 2))
    _assert_error_then_fallback(root, ckpt.step_dir(root, 2), caplog)
    shutil.rmtree(ckpt.step_dir(root, 1))
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):  # nothing to fall back to
        ckpt.resolve_for_load(root, fallback_to_previous=True)


def _disk_full(real, nbytes, when):
    """A write function that, for the paths ``when`` picks, writes ``nbytes`` then fails as a full disk does."""
    def write(*args, **kwargs):
        path = str(args[-1] if real.__name__ == "save_file" else args[0])
        if not when(path):
            return real(*args, **kwargs)
        with open(path, "wb") as f:
            f.write(b"x" * nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def test_full_disk_while_finalizing_names_the_file_and_removes_the_partial_files(tmp_path, monkeypatch):
    root = _two_checkpoints(tmp_path)
    real = ckpt._write_synced
    monkeypatch.setattr(ckpt, "_write_synced", _disk_full(real, 10, lambda path: path.endswith(ckpt.MANIFEST)))
    with pytest.raises(ckpt.CheckpointError, match="disk is full") as err:
        _fake_checkpoint(root, 3)
    tmp = os.path.join(root, ".tmp3")
    assert os.path.join(tmp, ckpt.MANIFEST) in str(err.value) and not os.path.exists(tmp)
    monkeypatch.setattr(ckpt, "_write_synced", _disk_full(real, 1, lambda path: ".latest.tmp" in path))
    with pytest.raises(ckpt.CheckpointError, match="disk is full") as err:
        _fake_checkpoint(root, 4)
    assert os.path.join(root, "latest") in str(err.value)
    assert sorted(os.listdir(root)) == ["latest", "step_0000001", "step_0000002", "step_0000004"]
    assert ckpt.resolve_for_load(root, fallback_to_previous=False) == ckpt.step_dir(root, 2)  # latest unchanged


def _stub_trainer(root):
    from types import SimpleNamespace as NS

    import torch

    opt = NS(master_of=lambda p: p, moment=lambda p, key: p * 0, adam_step=lambda: 1, scaler=None)
    ctx = NS(rank=0, optimizer=opt, model=NS(weight=torch.ones(3)), shape=None, sampler=NS(position=5))
    return NS(ctx=ctx, cfg=NS(checkpointing=NS(checkpoint_dir=root, keep_last_n=3)), step=3, version=3,
              gate=NS(dropped=0), consecutive_skips=0, probe=None)


def test_full_disk_during_save_names_the_file_and_removes_the_temp_folder(tmp_path, monkeypatch, megatron_single):
    import safetensors.torch

    from megatron_grpo import resume

    root = _two_checkpoints(tmp_path)
    trainer = _stub_trainer(root)
    monkeypatch.setattr(resume, "export_hf_tensors",
                        lambda model, shape, include_tied_lm_head, source: [("w", source("w", model.weight))])
    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", _disk_full(real, 100, lambda p: p.endswith(ckpt.EXP_AVG_FILE)))
    with pytest.raises(ckpt.CheckpointError, match="disk is full") as err:
        resume.save_checkpoint(trainer)
    tmp = os.path.join(root, ".step_0000003.tmp")
    assert os.path.join(tmp, ckpt.EXP_AVG_FILE) in str(err.value) and not os.path.exists(tmp)
    assert ckpt.list_checkpoints(root) == [1, 2] and ckpt.latest_step(root) == 2
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert resume.save_checkpoint(trainer) == ckpt.step_dir(root, 3)  # the next save (space freed) works
    ckpt.verify(ckpt.step_dir(root, 3))
    assert resume.read_trainer_state(ckpt.step_dir(root, 3))["data_position"] == 5


def test_server_killed_mid_run_recovers_without_corrupting_checkpoints(tmp_path, tiny_dense):
    os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP"] = "2"
    try:
        code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=3",
                                   "generation.backend=vllm_server", "generation.retry_timeout_s=5",
                                   "checkpointing.save_period=1", f"checkpointing.checkpoint_dir={tmp_path / 'ck'}"],
                                  str(tmp_path / "run"))
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP"]
    assert code == 0, out[-3000:]
    assert "restarting it" in out and [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["sync/logprob_abs_diff_mean"] for r in rows) < 1e-4  # re-pushed weights match
    for step in ckpt.list_checkpoints(str(tmp_path / "ck")):
        ckpt.verify(ckpt.step_dir(str(tmp_path / "ck"), step))


def test_generator_killed_in_every_phase_recovers_with_the_uninterrupted_metrics(tmp_path, tiny_dense):
    """The generator dies before step 2's generation, during step 3's weight push and before step
    4's parity probe: each time it is restarted and re-pushed, the retried generation asks for the
    same prompts and seeds, and every step's metrics equal an uninterrupted run's."""
    common = [f"policy.model_name={tiny_dense}", "grpo.max_num_steps=4"]
    code, out, straight = run_cli(common, str(tmp_path / "straight"))
    assert code == 0, out[-3000:]
    os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR"] = "generate:2,push:3,probe:4"
    try:
        code, out, rows = run_cli(common + ["checkpointing.save_period=1",
                                            f"checkpointing.checkpoint_dir={tmp_path / 'ck'}"], str(tmp_path / "run"))
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR"]
    assert code == 0, out[-3000:]
    for phase in ("generation at step 2", "the weight push at step 3", "the parity probe at step 4"):
        assert f"generator failed during {phase}" in out, phase
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(straight, rows):
        a, b = _stable(a), _stable(b)
        assert set(a) == set(b)
        for name in a:
            if a[name] is None or b[name] is None:  # NaN is written as null
                assert a[name] is b[name], (a["step"], name)
            else:
                assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-6), (a["step"], name)
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
              gate=NS(dropped=0), consecutive_skips=0, probe=None)


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
