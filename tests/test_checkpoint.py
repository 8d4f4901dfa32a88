"""Checkpoints and faults: exact resume after SIGKILL, TP re-layout, corrupt files, generator crash, NaN."""

import errno
import logging
import os
import shutil

import pytest

from megatron_grpo.checkpoint import folders as ckpt
from tests.test_train import run_cli

VOLATILE = ("time/", "timing/", "sync/push_s")


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny_dense):
    """The uninterrupted 4-step run the fault tests compare with (one launch for both)."""
    code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=4"],
                              str(tmp_path_factory.mktemp("straight")))
    assert code == 0, out[-3000:]
    return rows


@pytest.mark.vllm
def test_sigkill_between_steps_then_resume_reproduces_metrics_exactly(tmp_path, tiny_dense, straight_run):
    """SIGKILL after step 2, resume: steps 3 and 4 (and the end-of-run export) as in the uninterrupted run."""
    run_b = [f"policy.model_name={tiny_dense}", "grpo.max_num_steps=4", "checkpointing.save_period=1",
             f"checkpointing.checkpoint_dir={tmp_path / 'ck-b'}"]
    os.environ["MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"] = "2"
    try:
        code, _, killed = run_cli(run_b, str(tmp_path / "b"))
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"]
    assert code == -9 and [r["step"] for r in killed] == [1, 2]
    code, out, resumed = run_cli(run_b + ["checkpointing.resume=true", f"checkpointing.export_hf={tmp_path / 'hf'}"],
                                 str(tmp_path / "b"))
    assert code == 0, out[-3000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # each step once
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")  # the end-of-run export
    for a, b in zip(straight_run, resumed):
        assert _stable(a) == _stable(b), a["step"]
    for step in ckpt.list_checkpoints(str(tmp_path / "ck-b")):
        ckpt.verify(ckpt.step_dir(str(tmp_path / "ck-b"), step))


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
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.checkpoint.folders"):
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


@pytest.mark.vllm
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


@pytest.mark.vllm
def test_generator_killed_in_every_phase_recovers_with_the_uninterrupted_metrics(tmp_path, tiny_dense,
                                                                                 straight_run):
    """The generator dies before step 2's generation (and again while it restarts: the run's 2nd vLLM
    start), during step 3's weight push and before step 4's parity probe: each time it is restarted and
    re-pushed (the failed start is one more restart), the retried generation asks for the same prompts and
    seeds, and every step's metrics equal an uninterrupted run's."""
    common = [f"policy.model_name={tiny_dense}", "grpo.max_num_steps=4"]
    os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR"] = "generate:2,start:2,push:3,probe:4"
    try:
        code, out, rows = run_cli(common + ["checkpointing.save_period=1",
                                            f"checkpointing.checkpoint_dir={tmp_path / 'ck'}"], str(tmp_path / "run"))
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_KILL_GENERATOR"]
    assert code == 0, out[-3000:]
    for phase in ("generation at step 2", "the weight push at step 3", "the parity probe at step 4",
                  "its restart at step 2 (engine 0 of 1 failed to start: vLLM generator process died during start "
                  "(exit code -9))"):
        assert f"generator failed during {phase}" in out, phase
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(straight_run, rows):
        a, b = _stable(a), _stable(b)
        assert set(a) == set(b)
        for name in a:
            if a[name] is None or b[name] is None:  # NaN is written as null
                assert a[name] is b[name], (a["step"], name)
            else:
                assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-6), (a["step"], name)
    for step in ckpt.list_checkpoints(str(tmp_path / "ck")):
        ckpt.verify(ckpt.step_dir(str(tmp_path / "ck"), step))


@pytest.mark.vllm
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


# ---- dist_checkpointing: resume at another layout, full disks on one rank, HF export ----------------

LAYOUTS = {  # name: (model, world layout, overrides)
    "tp2": ("dense", dict(tp=2), []),
    "dp2-distopt": ("dense", dict(), ["policy.megatron_cfg.optimizer.use_distributed_optimizer=true"]),
    "ep2": ("moe", dict(ep=2), []),
    "pp2": ("dense", dict(pp=2), []),
}


def _advantages(step):
    import torch

    return torch.linspace(-1.0, 1.0, 8) * (1.0 if step % 2 else -0.5)


def _build(model_dir, layout, overrides, gloo_groups=None):
    """A stepper at ``layout`` (collective groups set) and this rank's slice of the step's rows;
    ``gloo_groups=False``: without Megatron's gloo groups, as on CUDA."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.parallel import state
    from tests.test_routing import ROWS, _stepper

    state.init_distributed()
    state.initialize_model_parallel(state.Layout(world_size=dist.get_world_size(), **layout),
                                    create_gloo_process_groups=gloo_groups)
    st = _stepper(model_dir, *overrides)
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return st, slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)


def _trainer(st, model_dir, root, step, async_save=False):
    from types import SimpleNamespace as NS

    import torch.distributed as dist

    ctx = NS(rank=dist.get_rank(), optimizer=st.optimizer, model=st.model, sampler=NS(position=10 * step),
             model_dir=model_dir)
    return NS(ctx=ctx, cfg=NS(checkpointing=NS(checkpoint_dir=root, keep_last_n=3, async_save=async_save,
                                               fully_parallel_load=True)),
              step=step, version=step, gate=NS(dropped=step), consecutive_skips=0, probe=None,
              in_flight_state=list, restore_in_flight=lambda saved: None)


def _train_step(st, rows, step):
    """Step ``step`` (1-based) on this rank's rows: its metrics, then the no-grad fp32 log-probs of
    every row after the update (they show the optimizer state's effect: moments and step). fp32, not the
    shadow's bf16: across layouts the weights agree to reduction order only, and one bf16 rounding of a weight
    flipped by that moves a log-prob by ~1e-3 (an AVX2 CPU, where bf16 GEMMs take another kernel, showed it)."""
    import torch

    from megatron_grpo.models.forward import pack
    from tests.test_routing import PROMPT, ROWS, SEQ, _metrics, _sequences, _step_batch

    metrics = _metrics(st, _step_batch(torch.full((ROWS, SEQ), -7.0), _advantages(step), rows=rows))
    return metrics, st.lowp_log_probs(pack(_sequences(), [PROMPT] * ROWS, 0), torch.float32)


def _disk_full_on_rank(rank):
    """Makes torch_dist's shard writer (run in forked writer processes) fail on ``rank`` as a full disk does."""
    import errno

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item

    def write_item(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if dist.get_rank() == rank:
        filesystem_async._write_item = write_item
    return lambda: setattr(filesystem_async, "_write_item", real)


def _save_worker(models, root):
    """2 ranks, each layout of LAYOUTS: step 1, save (EP=2: asynchronously, finalized after step 2);
    step 2 (the uninterrupted run); TP=2: a save of step 2 that fails on rank 1 (full disk), then
    one that works. Returns the step-2 results."""
    from megatron_grpo.checkpoint import resume

    results = {}
    for name, (model, layout, overrides) in LAYOUTS.items():
        st, rows = _build(models[model], layout, overrides)
        ck = os.path.join(root, name)
        _train_step(st, rows, 1)
        async_save = name == "ep2"  # written in the background while step 2 trains
        assert resume.save_checkpoint(_trainer(st, models[model], ck, 1, async_save)) == ckpt.step_dir(ck, 1)
        results[name] = _train_step(st, rows, 2)
        if async_save:
            assert ckpt.latest_step(ck) is None  # not finalized yet
            assert resume.finish_pending_save() == ckpt.step_dir(ck, 1)
        if name == "tp2":
            restore = _disk_full_on_rank(1)
            try:
                with pytest.raises(ckpt.CheckpointError) as err:
                    resume.save_checkpoint(_trainer(st, models[model], ck, 2))
            finally:
                restore()
            results["disk_full"] = str(err.value)
            results["after_disk_full"] = sorted(os.listdir(ck)), ckpt.latest_step(ck)
            resume.save_checkpoint(_trainer(st, models[model], ck, 2))  # space freed: the next save works
    return results


def _resume_worker(models, root):
    """1 rank, no distributed optimizer: each checkpoint of step 1 loaded, then step 2. Also the
    trainer's logits right after loading the TP=2 checkpoint (for the HF export)."""
    import torch

    from megatron_grpo.checkpoint import resume

    from megatron_grpo.checkpoint import sharded_state
    from megatron_grpo.models import forward_logits

    results = {}
    for name, (model, _, _) in LAYOUTS.items():
        st, rows = _build(models[model], {}, [])
        trainer = _trainer(st, models[model], os.path.join(root, name), 0)
        resume.load_checkpoint(trainer, ckpt.step_dir(os.path.join(root, name), 1))
        assert (trainer.step, trainer.version, trainer.ctx.sampler.position, trainer.gate.dropped) == (1, 1, 10, 1)
        steps = [ps.state["step"] for ps in sharded_state.param_states(st.optimizer.megatron)]
        assert len({id(s) for s in steps}) == len(steps) and all(s.item() == 1.0 for s in steps)  # one per param
        assert sharded_state.optimizer_step(st.optimizer.megatron) == 1
        if name == "tp2":
            ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
            with torch.no_grad():
                results["logits"] = (ids, forward_logits(st.model, ids).float())
        results[name] = _train_step(st, rows, 2)
    return results


def test_resume_at_another_layout_continues_like_the_uninterrupted_run(tmp_path, tiny_dense, tiny_moe):
    """Saved at TP=2, at DP=2 with the distributed optimizer, at EP=2 and at PP=2 (2 gloo ranks; the EP=2
    one asynchronously, while the next step trains), resumed on 1 rank without the distributed
    optimizer: step 2's metrics and the weights it leaves equal the uninterrupted 2-rank run's. A full disk on rank 1 is a CheckpointError naming the file on
    both ranks; the partial folder is removed and ``latest`` still names step 1. The TP=2
    checkpoint exported to HF loads in transformers with the trainer's logits."""
    import torch

    from tests._dist import run_distributed

    models, root = {"dense": tiny_dense, "moe": tiny_moe}, str(tmp_path / "ck")
    saved = run_distributed(_save_worker, 2, models, root)
    assert saved[0]["disk_full"] == saved[1]["disk_full"]
    assert "disk is full" in saved[0]["disk_full"] and os.path.join(root, "tp2", ".step_0000002.tmp", "__1_")\
        in saved[0]["disk_full"]
    assert saved[0]["after_disk_full"] == (["latest", "step_0000001"], 1)
    resumed = run_distributed(_resume_worker, 1, models, root)[0]
    for name in LAYOUTS:
        (straight, lp_straight), (again, lp_again) = saved[0][name], resumed[name]
        for key in straight:
            assert again[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6, nan_ok=True), (name, key)
        torch.testing.assert_close(lp_again, lp_straight, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for name in LAYOUTS:
        for step in ckpt.list_checkpoints(os.path.join(root, name)):
            ckpt.verify(ckpt.step_dir(os.path.join(root, name), step))
    _check_hf_export(ckpt.step_dir(os.path.join(root, "tp2"), 1), str(tmp_path / "hf"), *resumed["logits"])


def test_a_distributed_optimizer_range_becomes_row_rectangles():
    """A rank's flat range of a [rows, cols] weight is saved as a partial first row, whole rows and
    a partial last row, per block of rows (a GLU half), covering the range exactly."""
    from megatron_grpo.checkpoint.sharded_state import _rectangles

    assert list(_rectangles(3, 17, 0, 4, 5)) == [(0, 1, 3, 2), (1, 2, 0, 5), (3, 1, 0, 2)]
    assert list(_rectangles(3, 17, 2, 4, 5)) == [(0, 1, 0, 5), (1, 1, 0, 2)]  # rows [2, 4) only
    assert list(_rectangles(3, 4, 0, 4, 5)) == [(0, 1, 3, 1)] and list(_rectangles(0, 7, 0, 7, 1)) == [(0, 7, 0, 1)]


def _install_fused_adam():
    """Makes Megatron build a CPU stand-in of TE's FusedAdam, through its own seam: with TE importable
    ``megatron.core.optimizer`` picks ``Adam`` = FusedAdam (``USING_PYTORCH_OPTIMIZER = False``, so it
    passes ``adam_w_mode``) and the distributed optimizer accepts it (``isinstance(.., Adam)`` against
    its own import). The stand-in keeps FusedAdam's layout: the step count in
    ``param_groups[i]["step"]`` (set by the first update, advanced for groups with params only),
    per-parameter state ``exp_avg`` / ``exp_avg_sq`` only, Adam's bias correction from the group's
    step, the update of TE's / apex's multi_tensor_adam (``adam_w_mode``: decoupled weight decay)."""
    import torch
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    class FusedAdam(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                     weight_decay=0.0, capturable=False):  # Megatron-Core 0.17+ passes capturable, as TE's takes
            assert not capturable, "CUDA-graph capturable steps are not emulated"
            super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                          weight_decay=weight_decay))
            self.adam_w_mode = adam_w_mode

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                if not group["params"]:
                    continue
                group["step"] = group["step"] + 1 if "step" in group else 1
                (beta1, beta2), step, decay = group["betas"], group["step"], group["weight_decay"]
                c1, c2 = (1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"] else (1.0, 1.0)
                for p in (p for p in group["params"] if p.grad is not None):
                    state = self.state[p]
                    if not state:
                        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    grad = p.grad if self.adam_w_mode else p.grad.add(p, alpha=decay)
                    state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    update = (state["exp_avg"] / c1) / ((state["exp_avg_sq"] / c2).sqrt() + group["eps"])
                    p.add_(update.add_(p, alpha=decay) if self.adam_w_mode else update, alpha=-group["lr"])

    megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    distrib_optimizer.Adam, distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = \
        FusedAdam, True, True
    return FusedAdam


def _adam_snapshot(st):
    """The weights, this rank's Adam moments and both forms of its step count."""
    from megatron_grpo.checkpoint import sharded_state

    opt = st.optimizer.megatron
    states = [ps.state for ps in sharded_state.param_states(opt)]
    return dict(params={n: p.detach().clone() for n, p in st.model.named_parameters()},
                moments=[s[name].clone() for s in states for name in ("exp_avg", "exp_avg_sq")],
                state_keys={tuple(sorted(s)) for s in states}, param_step=sharded_state.optimizer_step(opt),
                group_step=sharded_state.optimizer_group_step(opt),
                groups=[g.get("step") for o in st.optimizer.chained for g in o.optimizer.param_groups if g["params"]])


def _fused_adam_worker(model_dir, root, steps=3, saved_at=1):
    """2 ranks, DP=2 with the distributed optimizer, no gloo groups (as on CUDA), FusedAdam: ``steps``
    uninterrupted updates; then ``saved_at`` updates, a save, a load into a fresh optimizer and the
    remaining updates. Also that checkpoint loaded into torch's AdamW (the per-parameter form)."""
    import megatron.core.optimizer as megatron_optimizer
    import torch

    from megatron_grpo.checkpoint import resume

    from megatron_grpo.checkpoint import sharded_state
    from megatron_grpo.parallel import state

    fused, ck = _install_fused_adam(), os.path.join(root, "fused")
    overrides = ["policy.megatron_cfg.optimizer.use_distributed_optimizer=true"]

    def build():
        st, rows = _build(model_dir, {}, overrides, gloo_groups=False)
        assert not state.has_gloo_groups()
        kinds = [(type(o).__name__, type(o.optimizer)) for o in st.optimizer.chained]
        assert kinds == [("DistributedOptimizer", fused)], kinds
        return st, rows

    st, rows = build()
    out = {"straight": [_train_step(st, rows, s) for s in range(1, steps + 1)][-1] + (_adam_snapshot(st),)}
    st, rows = build()
    for s in range(1, saved_at + 1):
        _train_step(st, rows, s)
    resume.save_checkpoint(_trainer(st, model_dir, ck, saved_at))
    saved = ckpt.read_trainer_state(ckpt.step_dir(ck, saved_at))
    out["saved"] = saved["optimizer_step"], saved["optimizer_group_step"]
    st, rows = build()
    resume.load_checkpoint(_trainer(st, model_dir, ck, 0), ckpt.step_dir(ck, saved_at))
    out["loaded"] = _adam_snapshot(st)
    out["resumed"] = [_train_step(st, rows, s) for s in range(saved_at + 1, steps + 1)][-1] + (_adam_snapshot(st),)
    megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, True
    st, _ = _build(model_dir, {}, [])
    resume.load_checkpoint(_trainer(st, model_dir, ck, 0), ckpt.step_dir(ck, saved_at))
    out["into_adamw"] = [ps.state["step"] for ps in sharded_state.param_states(st.optimizer.megatron)]
    return out


def test_fused_adam_group_step_resumes_at_dp2_without_gloo_groups(tmp_path, tiny_dense):
    """On CUDA Megatron's gloo groups are not created: the optimizer is built without them (Megatron's
    default asserts on them) and trains, saves and loads. FusedAdam (TE / apex) counts Adam's steps
    in its param groups: saved (trainer state ``optimizer_group_step``) and restored there, so after
    resuming at DP=2 into the distributed optimizer the group step continues (2, 3, not 1, 2) and the
    weights, moments and metrics equal the uninterrupted run's. The same checkpoint resumes into
    torch's AdamW with one step tensor per parameter."""
    import torch

    from tests._dist import run_distributed

    for out in run_distributed(_fused_adam_worker, 2, tiny_dense, str(tmp_path / "ck")):
        assert out["saved"] == (0, 1)  # FusedAdam keeps no per-parameter step
        loaded = out["loaded"]
        assert loaded["group_step"] == 1 and set(loaded["groups"]) == {1} and loaded["param_step"] == 0
        assert loaded["state_keys"] == {("exp_avg", "exp_avg_sq")}  # FusedAdam's layout: no per-param step
        (metrics, lp, straight), (metrics_again, lp_again, again) = out["straight"], out["resumed"]
        assert straight["groups"] == again["groups"] and set(again["groups"]) == {3}
        for key in metrics:
            assert metrics_again[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-7, nan_ok=True), key
        torch.testing.assert_close(lp_again, lp, rtol=0, atol=1e-6)
        for name, p in straight["params"].items():
            torch.testing.assert_close(again["params"][name], p, rtol=0, atol=1e-7, msg=name)
        torch.testing.assert_close(again["moments"], straight["moments"], rtol=0, atol=1e-9)
        steps = out["into_adamw"]
        assert len({id(s) for s in steps}) == len(steps) and {s.item() for s in steps} == {1.0}


def _live_tensor_bytes():
    """Bytes of every tensor storage alive in this process (an independent view of the exporter's peak)."""
    import gc

    import torch

    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _check_hf_export(path, out, ids, trainer_logits):
    """export-hf: sharded safetensors + index + config + tokenizer that transformers loads, with the
    trainer's logits; tensors held while exporting stay below twice the largest layer (counted by
    the exporter and, independently, by scanning every live tensor after each parameter and layer)."""
    import json

    import torch
    import transformers
    from safetensors import safe_open

    from megatron_grpo.cli import main
    from megatron_grpo.checkpoint.export import export_hf

    baseline, seen = _live_tensor_bytes(), []
    report = export_hf(path, out, progress=lambda unit: seen.append(_live_tensor_bytes() - baseline))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert sorted(set(weight_map.values())) == report.files and len(report.files) == 4 + 2  # embed, 4 layers, head
    largest = max(os.path.getsize(os.path.join(out, f)) for f in report.files)
    assert report.largest_unit_bytes <= largest < 1.01 * report.largest_unit_bytes  # fp32: as read = as written
    assert report.peak_bytes < 2 * report.largest_unit_bytes and max(seen) < 2 * report.largest_unit_bytes
    assert os.path.isfile(os.path.join(out, "tokenizer.json")) and os.path.isfile(os.path.join(out, "config.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trainer_logits, rtol=0, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "<|endoftext|>"
    assert main(["export-hf", os.path.dirname(path), out + "-bf16", "--dtype", "bfloat16"]) == 0  # latest: step 2
    with safe_open(os.path.join(out + "-bf16", report.files[1]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_tampered_trainer_state_cannot_run_code_on_resume(tmp_path):
    """``trainer_state.pt`` is unpickled with weights_only=True: a crafted pickle is refused (a
    CheckpointError naming the file) and its payload never runs."""
    import torch

    from megatron_grpo.checkpoint.folders import read_trainer_state

    marker = tmp_path / "pwned"
    torch.save({"step": 1, "payload": _Exploit(str(marker))}, tmp_path / ckpt.STATE_FILE)
    with pytest.raises(ckpt.CheckpointError, match=ckpt.STATE_FILE):
        read_trainer_state(str(tmp_path))
    assert not marker.exists()
    torch.save({"step": 3, "rng": [{"torch": torch.get_rng_state()}], "parity": {"sequences": [[1, 2]],
                "prompt_lens": [1], "baseline": {"sync/logprob_abs_diff_mean": 1e-7}}}, tmp_path / ckpt.STATE_FILE)
    assert read_trainer_state(str(tmp_path))["step"] == 3  # what the trainer saves loads as plain data


def _fake_cuda_scale():
    """Megatron's fp16 loss scale as it lives on a rank's GPU: a tensor that reports cuda:0 (its
    ``.cpu()`` a plain host copy)."""
    import torch

    from tests._fakes import OnFakeGPU

    return torch.tensor([65536.0]).as_subclass(OnFakeGPU)


def _tag_as_cuda(monkeypatch, tensor):
    """``torch.save`` writes ``tensor``'s storage with the location tag ``cuda:0``, as on a GPU rank."""
    import torch

    ptr = tensor.untyped_storage().data_ptr()
    registry = list(torch.serialization._package_registry)
    tag = lambda storage: "cuda:0" if storage.data_ptr() == ptr else None  # noqa: E731
    registry.insert(0, (0, tag, lambda storage, location: None))
    monkeypatch.setattr(torch.serialization, "_package_registry", registry)


def test_fp16_loss_scaler_state_is_saved_and_loaded_in_host_memory(tmp_path, monkeypatch):
    """The fp16 grad scaler's scale (a CUDA tensor on every rank) goes into ``trainer_state.pt`` as a
    host tensor, and the file loads with ``map_location="cpu"``: a state saved from cuda:0 (an older
    checkpoint) loads on a host without touching GPU 0 (here: without CUDA at all)."""
    from types import SimpleNamespace as NS

    import torch

    from megatron_grpo.checkpoint import resume

    scaler = NS(state_dict=lambda: {"scale": _fake_cuda_scale(), "growth_tracker": 3, "hysteresis_tracker": 2})
    opt = NS(megatron=NS(chained_optimizers=[NS(grad_scaler=scaler, is_stub_optimizer=False)]),
             scheduler=NS(state_dict=dict))
    trainer = NS(ctx=NS(optimizer=opt, sampler=NS(position=4)), step=2, version=2, gate=NS(dropped=0),
                 consecutive_skips=0, probe=None)
    state = resume.trainer_state(trainer, [], 2, True, True)
    (saved,) = state["scalers"]
    assert type(saved["scale"]) is torch.Tensor and saved["scale"].device.type == "cpu", saved["scale"].device
    assert saved["scale"].item() == 65536.0 and saved["growth_tracker"] == 3
    scale = torch.tensor([1024.0])
    _tag_as_cuda(monkeypatch, scale)
    torch.save({"step": 2, "scalers": [{"scale": scale, "growth_tracker": 0, "hysteresis_tracker": 2}]},
               tmp_path / ckpt.STATE_FILE)
    loaded = ckpt.read_trainer_state(str(tmp_path))["scalers"][0]["scale"]
    assert loaded.device.type == "cpu" and loaded.item() == 1024.0


# Megatron-Core 0.16.1's keys maps (gpt_layer_specs.py). TE's dense and MoE layers: the input norm is
# fused into linear_qkv (TELayerNormColumnParallelLinear, saved as linear_qkv.layer_norm_weight), so a
# local-spec model stands in for them with that rename added; TE's dense pre-MLP norm is fused into
# linear_fc1 the same way, its MoE one is a separate TENorm that TE's map (op-fuser names only) keeps
# as pre_mlp_layernorm.weight.
_TE_OP_FUSER_MAP = {"mlp.0.weight": "mlp.linear_fc1.layer_norm_weight", "mlp.0.bias": "mlp.linear_fc1.layer_norm_bias",
                    "mlp.1.basic_ops.0.weight": "mlp.linear_fc1.weight", "mlp.1.basic_ops.1.bias": "mlp.linear_fc1.bias",
                    "mlp.3.basic_ops.0.weight": "mlp.linear_fc2.weight", "mlp.3.basic_ops.1.bias": "mlp.linear_fc2.bias"}
KEY_MAPS = {
    "local": {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
              "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
    "te-dense": {**_TE_OP_FUSER_MAP, "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                 "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
    "te-moe": {**_TE_OP_FUSER_MAP, "input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
}
CROSS_SPEC = [("moe", "te-moe", "local"), ("moe", "local", "te-moe"), ("dense", "te-dense", "local"),
              ("dense", "local", "te-dense")]


def _use_keys_map(model, name):
    import dataclasses

    from megatron_grpo.models import unwrap

    for layer in unwrap(model).decoder.layers:
        layer.submodules_config = dataclasses.replace(layer.submodules_config,
                                                      sharded_state_dict_keys_map=dict(KEY_MAPS[name]))


def _cross_spec_worker(models, root):
    """1 rank: for each (model, saving spec's keys, loading spec's keys): a step, a save, the
    checkpoint's norm keys, a fresh model with the other keys map loading it, its weights and
    optimizer moments against the saved ones, and the HF export's post-attention norms."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_grpo.checkpoint import resume, sharded_state
    from megatron_grpo.checkpoint.export import export_hf
    from megatron_grpo.models import unwrap

    out = {}
    for model, save_map, load_map in CROSS_SPEC:
        name, ck = f"{model}-{save_map}-to-{load_map}", os.path.join(root, f"{model}-{save_map}-to-{load_map}")
        st, rows = _build(models[model], {}, [])
        _use_keys_map(st.model, save_map)
        _train_step(st, rows, 1)
        path = resume.save_checkpoint(_trainer(st, models[model], ck, 1))
        keys = sorted(k for k in FileSystemReader(path).read_metadata().state_dict_metadata
                      if "norm" in k and "optimizer" not in k)
        again, _ = _build(models[model], {}, [])
        _use_keys_map(again.model, load_map)
        resume.load_checkpoint(_trainer(again, models[model], ck, 0), path)
        saved = dict(unwrap(st.model).named_parameters())
        weights = all(torch.equal(p, saved[n]) for n, p in unwrap(again.model).named_parameters())
        moments = [(a.state["exp_avg"], b.state["exp_avg"]) for a, b in zip(
            sharded_state.param_states(st.optimizer.megatron), sharded_state.param_states(again.optimizer.megatron))]
        report = export_hf(path, os.path.join(root, f"{name}-hf"))
        norms = {}
        for f in report.files:
            with safe_open(os.path.join(root, f"{name}-hf", f), "pt") as st_file:
                norms.update({k: st_file.get_tensor(k) for k in st_file.keys() if "post_attention_layernorm" in k})
        expected = {f"model.layers.{i}.post_attention_layernorm.weight": layer.pre_mlp_layernorm.weight.detach()
                    for i, layer in enumerate(unwrap(st.model).decoder.layers)}
        out[name] = dict(keys=keys, weights=weights, moments=all(torch.equal(a, b) for a, b in moments),
                         num_moments=len(moments), norms=sorted(norms) == sorted(expected)
                         and all(torch.equal(norms[k], v) for k, v in expected.items()))
    return out


def test_te_and_local_layer_checkpoints_load_into_each_other_and_export(tmp_path, tiny_dense, tiny_moe):
    """Checkpoints keyed as Transformer Engine's layer specs key them (MoE: the pre-MLP norm as
    ``pre_mlp_layernorm.weight``, a separate TENorm; dense: fused, ``mlp.linear_fc1.layer_norm_weight``),
    written by local-spec models with TE's keys map, load into local-spec models (and local checkpoints
    into TE-keyed models) with the same weights and Adam moments, and ``export-hf`` writes each layer's
    post-attention norm from them."""
    from tests._dist import run_distributed

    out = run_distributed(_cross_spec_worker, 1, {"dense": tiny_dense, "moe": tiny_moe}, str(tmp_path / "ck"))[0]
    norm_keys = {"te-moe": "decoder.layers.pre_mlp_layernorm.weight",
                 "local": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                 "te-dense": "decoder.layers.mlp.linear_fc1.layer_norm_weight"}
    for model, save_map, load_map in CROSS_SPEC:
        got = out[f"{model}-{save_map}-to-{load_map}"]
        assert norm_keys[save_map] in got["keys"] and "decoder.layers.self_attention.linear_qkv.layer_norm_weight" \
            in got["keys"], got["keys"]
        assert got["weights"] and got["moments"] and got["num_moments"] > 0 and got["norms"], (model, save_map, got)


def test_a_llama_run_exports_hf_with_its_config_and_weights(tmp_path, tiny_llama):
    """A recipe naming a Llama folder (no QK-norm, tied embeddings) runs a step (the trainer's own
    generation), saves, and export-hf writes a Llama HF model back: its config, no q/k-norm and no
    lm_head tensors, the weights it loaded (lr 1e-12: Adam moves each by <= 1e-12), transformers' logits."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    code, log, rows = run_cli([f"policy.model_name={tiny_llama}", "generation.backend=megatron", "grpo.max_num_steps=1",
                               "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
                               "generation.max_new_tokens=8", "policy.megatron_cfg.optimizer.lr=1e-12",
                               f"checkpointing.checkpoint_dir={tmp_path / 'ck'}", f"checkpointing.export_hf={out}"],
                              str(tmp_path / "run"))
    assert code == 0, log[-3000:]
    assert [r["step"] for r in rows] == [1]
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["tie_word_embeddings"]) == (
        "llama", ["LlamaForCausalLM"], True)
    exported = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            exported.update(load_file(str(out / name)))
    original = load_file(os.path.join(tiny_llama, "model.safetensors"))
    assert set(exported) == set(original) and not [n for n in exported if "q_norm" in n or "k_norm" in n]
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-9, msg=name)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(ids).logits
                  for d in (str(out), tiny_llama)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
