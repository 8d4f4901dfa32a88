"""Process-group and Megatron model-parallel initialisation, with or without torchrun."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.compat.megatron import clear_module_caches, destroy_model_parallel
from megatron_grpo.parallel import cpu, net
from megatron_grpo.parallel.stages import PipelineSplit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor x pipeline x data (x context) with experts over ``ep`` x ``etp``."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    split: PipelineSplit = PipelineSplit()
    """How the decoder layers split over the ``pp`` stages (even unless Megatron's uneven fields are set)."""

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)


def validate_layout(layout: Layout, *, num_layers: Optional[int] = None, num_experts: Optional[int] = None,
                    num_query_groups: Optional[int] = None, prefix: str = "policy.megatron_cfg") -> None:
    """Raises ``ValueError`` naming the key when the layout cannot work for this world size/model."""
    names = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
             "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
             "cp": "context_parallel_size"}
    for attr, key in names.items():
        if getattr(layout, attr) < 1:
            raise ValueError(f"{prefix}.{key} must be >= 1, got {getattr(layout, attr)}")
    mp = layout.tp * layout.pp * layout.cp
    if layout.world_size % mp:
        raise ValueError(f"{prefix}.tensor_model_parallel_size ({layout.tp}) x {prefix}.pipeline_model_parallel_size "
                         f"({layout.pp}) x {prefix}.context_parallel_size ({layout.cp}) = {mp} does not divide the "
                         f"world size {layout.world_size}")
    if (layout.world_size // layout.pp) % (layout.ep * layout.etp):
        raise ValueError(f"{prefix}.expert_model_parallel_size ({layout.ep}) x {prefix}.expert_tensor_parallel_size "
                         f"({layout.etp}) = {layout.ep * layout.etp} does not divide world size / "
                         f"{prefix}.pipeline_model_parallel_size = {layout.world_size // layout.pp}")
    if num_layers is not None:
        layout.split.chunk_layers(num_layers, layout.pp)  # ValueError naming the keys
    if num_experts and layout.split.vpp > 1:
        raise ValueError(f"{prefix}.virtual_pipeline_model_parallel_size={layout.split.vpp} with a MoE model "
                         f"(num_experts={num_experts}): the routing control (models/routing.py) over several model "
                         "chunks is not wired; leave it null")
    if layout.ep > 1 and num_experts is not None and not num_experts:
        raise ValueError(f"{prefix}.expert_model_parallel_size={layout.ep} needs a MoE model (num_experts > 0)")
    if num_experts and num_experts % layout.ep:
        raise ValueError(f"{prefix}.expert_model_parallel_size={layout.ep} does not divide num_experts={num_experts}")
    if num_query_groups is not None and num_query_groups % layout.tp:
        raise ValueError(f"{prefix}.tensor_model_parallel_size={layout.tp} does not divide num_key_value_heads={num_query_groups}")


DEFAULT_TIMEOUT_MINUTES = 30.0
"""Collective timeout when the caller names none (``cluster.distributed_timeout_minutes``' default)."""


def init_distributed(backend: Optional[str] = None, timeout_minutes: Optional[float] = None) -> None:
    """Initialises the default process group from torchrun's env, or as a 1-process group, with a
    collective timeout of ``timeout_minutes`` (rank 0 alone may start vLLM or score for minutes).
    Under torchrun, gloo binds to this node's interface on the route to ``MASTER_ADDR`` (``net``)."""
    cpu.install()
    if dist.is_initialized():
        return
    if cpu.cuda_available():  # Megatron-LM's rule: with one GPU per task (srun --gpus-per-task=1) each
        # rank sees only its own, as device 0; with every GPU of the node visible this is LOCAL_RANK
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    timeout = timedelta(minutes=timeout_minutes or DEFAULT_TIMEOUT_MINUTES)
    if "RANK" in os.environ:  # torchrun (or a launcher that sets the env:// variables)
        net.bind_gloo_to_route()  # before any gloo group: each reads GLOO_SOCKET_IFNAME when made
        dist.init_process_group(backend=backend or cpu.default_backend(), timeout=timeout)
        return
    # a single process: an in-memory store, so nothing listens on any network interface (a TCP
    # store binds every interface whatever its URL says), and no RANK/MASTER_PORT is exported
    dist.init_process_group(backend=backend or cpu.default_backend(), store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)


def initialize_model_parallel(layout: Layout, seed: int = 1234, timeout_minutes: Optional[float] = None,
                              create_gloo_process_groups: Optional[bool] = None) -> None:
    """``parallel_state.initialize_model_parallel`` for ``layout`` plus the RNG streams; Megatron's
    groups get the collective timeout ``timeout_minutes`` too. Megatron's extra gloo copies of the
    data-parallel groups are created on CPU only (``create_gloo_process_groups=None``; on CUDA they
    would be idle duplicates of the NCCL groups): ``has_gloo_groups`` tells the optimizer."""
    from megatron.core import parallel_state as ps

    init_distributed(timeout_minutes=timeout_minutes)
    if layout.world_size != dist.get_world_size():
        raise ValueError(f"layout is for {layout.world_size} ranks but the world has {dist.get_world_size()}")
    validate_layout(layout)
    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=layout.split.vpp if layout.split.vpp > 1 else None,
        distributed_timeout_minutes=timeout_minutes or DEFAULT_TIMEOUT_MINUTES,  # a timedelta there: floats work
        create_gloo_process_groups=(not cpu.cuda_available() if create_gloo_process_groups is None
                                    else create_gloo_process_groups),
    )
    cpu.model_parallel_seed(seed)
    logger.info("parallel layout: world=%d tp=%d pp=%d cp=%d ep=%d etp=%d dp=%d", layout.world_size, layout.tp,
                layout.pp, layout.cp, layout.ep, layout.etp, layout.dp)


def has_gloo_groups() -> bool:
    """Megatron's gloo data-parallel groups (dense and expert) exist: what ``get_megatron_optimizer``
    must be told (``use_gloo_process_groups``; it asserts on missing ones). Asks Megatron's
    ``parallel_state`` itself, so it holds however the groups were initialised."""
    from megatron.core import parallel_state as ps

    try:
        groups = (ps.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True),
                  ps.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True))
    except AssertionError:  # "... group-gloo is not initialized"
        return False
    return all(group is not None for group in groups)


def destroy() -> None:
    """Tears down Megatron's groups and the default process group (with every group it registered)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


GLOO_WORKER_THREAD = "pt_gloo_runloop"
"""The OS thread name of a gloo process group's worker threads (torch's ``ProcessGroupGloo``)."""


def gloo_worker_threads() -> Optional[int]:
    """How many gloo worker threads this process runs (two per live gloo group); None where the OS
    does not tell (no ``/proc/self/task``)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended meanwhile
            continue
    return count


def shutdown() -> Optional[int]:
    """The end of a run, on each rank after its last collective, once the trainer is dropped: frees
    every process group while the interpreter is fully alive; returns the gloo worker threads left
    (0; None where unknown). A gloo group's worker thread drops its reference to a finished
    collective (and its tensors) only after the caller has moved on; groups still alive when the
    interpreter finalizes race that release against it, and a worker that then needs the GIL to free
    a tensor's Python object is ended by ``pthread_exit``, whose unwinding through a ``noexcept``
    destructor aborts the process ("terminate called without an active exception"). Freeing a group
    joins its workers first. Local, not collective: no rank waits for another."""
    clear_module_caches()
    gc.collect()  # reference cycles that still hold a model or an optimizer (and their groups)
    destroy()
    left = gloo_worker_threads()
    if left:
        logger.warning("%d gloo worker threads outlive the process groups' teardown: something still holds a "
                       "gloo group, and the exit may abort ('terminate called without an active exception')", left)
    elif left == 0:
        logger.info("process groups destroyed: no gloo worker thread left")
    return left
