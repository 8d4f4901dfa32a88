"""Parallel layout validation (errors name the key) and model-parallel initialisation."""

import pytest

from megatron_grpo.parallel.stages import PipelineSplit
from megatron_grpo.parallel.state import Layout, has_gloo_groups, validate_layout


@pytest.mark.parametrize("layout, kwargs, key", [
    (Layout(world_size=4, tp=3), {}, r"policy\.megatron_cfg\.tensor_model_parallel_size \(3\)"),
    (Layout(world_size=2, tp=1, ep=4), {}, r"policy\.megatron_cfg\.expert_model_parallel_size \(4\)"),
    (Layout(world_size=2, pp=2), {"num_layers": 3}, "pipeline_model_parallel_size"),
    (Layout(world_size=2, ep=2), {"num_experts": 3}, "expert_model_parallel_size"),
    (Layout(world_size=2, ep=2), {"num_experts": 0}, "expert_model_parallel_size"),
    (Layout(world_size=2, tp=2), {"num_query_groups": 1}, "tensor_model_parallel_size"),
    (Layout(world_size=2, tp=0), {}, "tensor_model_parallel_size"),
    (Layout(world_size=2, pp=2, split=PipelineSplit(virtual_pipeline_model_parallel_size=2)), {"num_experts": 8},
     r"virtual_pipeline_model_parallel_size=2 with a MoE model \(num_experts=8\).*leave it null"),
])
def test_impossible_layouts_name_the_key(layout, kwargs, key):
    with pytest.raises(ValueError, match=key):
        validate_layout(layout, **kwargs)


def test_valid_layouts_pass_and_dp_is_derived():
    layout = Layout(world_size=16, tp=2, pp=2, ep=4)
    validate_layout(layout, num_layers=48, num_experts=128, num_query_groups=4)
    assert layout.dp == 4


def test_each_rank_takes_local_rank_modulo_its_visible_gpus(monkeypatch):
    """``srun --gpus-per-task=1``: every rank sees one GPU (its own, as device 0); LOCAL_RANK=3 must pick
    device 3 % 1 = 0 (Megatron-LM's rule), not the invalid ordinal 3."""
    import torch

    from megatron_grpo.parallel import state

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setattr(state.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(state.dist, "init_process_group", lambda **kwargs: None)  # a fake process group
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "3")
    state.init_distributed(backend="gloo")
    assert picked == [0]


def test_megatron_groups_follow_the_layout(megatron_single):
    from megatron.core import parallel_state as ps

    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_expert_model_parallel_world_size() == 1
    assert has_gloo_groups()  # created on CPU (not on CUDA): what the optimizer is told


def test_single_process_world_opens_no_network_listener():
    """A one-process run keeps its rendezvous store in memory: nothing listens on any interface."""
    import subprocess
    import sys

    code = ("import torch.distributed as dist\n"
            "from megatron_grpo.parallel import state\n"
            "state.init_distributed()\n"
            "store = dist.distributed_c10d._get_default_store()\n"
            "store = getattr(store, 'underlying_store', store)\n"
            "print(type(store).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert out.stdout.strip().splitlines()[-1] == "HashStore", out.stderr[-2000:]


def _late_tp_collective():
    """Megatron's TP group of 2 ranks with a 1 s collective timeout; rank 0 joins its all-reduce 4 s late."""
    import time

    import torch
    from megatron.core import parallel_state as ps

    from megatron_grpo.parallel import cpu, state
    from tests._dist import file_barrier

    cpu.install()
    file_barrier()  # the 1 s timeout also bounds the rendezvous: start it with both ranks' imports done
    state.initialize_model_parallel(Layout(world_size=2, tp=2), timeout_minutes=1.0 / 60)
    if ps.get_tensor_model_parallel_rank() == 0:
        time.sleep(4.0)
    started = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(1), group=ps.get_tensor_model_parallel_group())
        timed_out = False
    except Exception:  # noqa: BLE001 - gloo raises on a timed-out collective
        timed_out = True
    return ps.get_tensor_model_parallel_rank(), timed_out, time.monotonic() - started


def test_collective_timeout_reaches_megatrons_groups():
    """``cluster.distributed_timeout_minutes`` bounds a wait in Megatron's own groups (TP here), not only in
    the default group: the early rank gives up after ~1 s instead of the 30-minute default."""
    from tests._dist import run_distributed

    results = {rank: (timed_out, waited) for rank, timed_out, waited in run_distributed(_late_tp_collective, 2)}
    assert results[1][0] and results[1][1] < 3.5, results


def _shutdown_after_a_model_ran():
    """Megatron's groups, a rotary embedding that ran (Megatron caches it, with its context-parallel
    group), a last collective, then ``shutdown``: (gloo workers before, gloo workers left, world still up)."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_grpo.parallel import state

    state.initialize_model_parallel(Layout(world_size=2))
    rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    rotary(4)
    box = [torch.distributed.get_rank()]
    torch.distributed.broadcast_object_list(box, src=0)  # the kind of collective a run ends with
    before = state.gloo_worker_threads()
    del rotary
    return before, state.shutdown(), torch.distributed.is_initialized()


def test_shutdown_frees_every_gloo_group_before_exit():
    """No gloo worker thread outlives ``shutdown``: none is left to race the interpreter's finalization
    (a worker freeing a finished collective's tensors then aborts the process: 'terminate called without
    an active exception'). Megatron's forgotten groups and its rotary-embedding cache included."""
    from tests._dist import run_distributed

    for before, left, initialized in run_distributed(_shutdown_after_a_model_ran, 2):
        assert before >= 2 and left == 0 and not initialized, (before, left, initialized)
