"""Process-group and Megatron model-parallel initialisation, with or without torchrun."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.parallel import cpu

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
    if num_layers is not None and num_layers % layout.pp:
        raise ValueError(f"{prefix}.pipeline_model_parallel_size={layout.pp} does not divide num_hidden_layers={num_layers}")
    if layout.ep > 1 and num_experts is not None and not num_experts:
        raise ValueError(f"{prefix}.expert_model_parallel_size={layout.ep} needs a MoE model (num_experts > 0)")
    if num_experts and num_experts % layout.ep:
        raise ValueError(f"{prefix}.expert_model_parallel_size={layout.ep} does not divide num_experts={num_experts}")
    if num_query_groups is not None and num_query_groups % layout.tp:
        raise ValueError(f"{prefix}.tensor_model_parallel_size={layout.tp} does not divide num_key_value_heads={num_query_groups}")


def init_distributed(backend: Optional[str] = None) -> None:
    """Initialises the default process group from torchrun's env, or as a 1-process group."""
    cpu.install()
    if dist.is_initialized():
        return
    if cpu.cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:  # torchrun (or a launcher that sets the env:// variables)
        dist.init_process_group(backend=backend or cpu.default_backend())
        return
    # a single process: an in-memory store, so nothing listens on any network interface (a TCP
    # store binds every interface whatever its URL says), and no RANK/MASTER_PORT is exported
    dist.init_process_group(backend=backend or cpu.default_backend(), store=dist.HashStore(), rank=0, world_size=1)


def initialize_model_parallel(layout: Layout, seed: int = 1234) -> None:
    """``parallel_state.initialize_model_parallel`` for ``layout`` plus the RNG streams."""
    from megatron.core import parallel_state as ps

    init_distributed()
    if layout.world_size != dist.get_world_size():
        raise ValueError(f"layout is for {layout.world_size} ranks but the world has {dist.get_world_size()}")
    validate_layout(layout)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=not cpu.cuda_available(),
    )
    cpu.model_parallel_seed(seed)
    logger.info("parallel layout: world=%d tp=%d pp=%d cp=%d ep=%d etp=%d dp=%d", layout.world_size, layout.tp,
                layout.pp, layout.cp, layout.ep, layout.etp, layout.dp)


def destroy() -> None:
    """Tears down Megatron's groups and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
