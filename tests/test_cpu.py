"""The CPU runtime for Megatron-Core: forward/backward in every precision, RNG tracker, CUDA no-op."""

import pytest
import torch

from tests._dist import run_distributed


@pytest.mark.parametrize("mode", ["fp32", "bf16_autocast", "bf16_params"])
def test_forward_backward_runs_on_cpu(mode, tiny_dense, megatron_single):
    from megatron_grpo.parallel.logprobs import token_log_probs
    from megatron_grpo.models import build_from_hf, forward_logits

    params_dtype = torch.bfloat16 if mode == "bf16_params" else torch.float32
    model, _ = build_from_hf(tiny_dense, params_dtype=params_dtype)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16_autocast"):
        logits = forward_logits(model, ids)
    if mode == "bf16_autocast":
        assert logits.dtype == torch.bfloat16
    log_probs = token_log_probs(logits[:, :-1], ids[:, 1:])
    assert log_probs.dtype == torch.float32 and torch.isfinite(log_probs).all()
    log_probs.mean().backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(p.dtype == params_dtype for p in params)
    assert sum(g.abs().sum().item() for g in grads) > 0


def test_rng_tracker_forks_distinct_streams(megatron_single):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    outer = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the named stream advances
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched


def _tp_rng_worker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=2, tp=2), seed=7)
    with get_cuda_rng_tracker().fork():
        tp_sample = torch.rand(3)
    return tp_sample, torch.rand(3)


def test_tp_ranks_get_distinct_model_parallel_streams_and_same_default():
    (tp0, d0), (tp1, d1) = run_distributed(_tp_rng_worker, 2)
    assert not torch.equal(tp0, tp1)
    assert torch.equal(d0, d1)


def test_install_is_noop_with_cuda(monkeypatch):
    from megatron_grpo.parallel import cpu

    monkeypatch.setattr(cpu, "_INSTALLED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    called = []
    monkeypatch.setattr(cpu, "_patch_torch_cuda", lambda: called.append("torch"))
    monkeypatch.setattr(cpu, "_patch_megatron", lambda: called.append("megatron"))
    cpu.install()
    assert called == []
    assert cpu._INSTALLED is False
