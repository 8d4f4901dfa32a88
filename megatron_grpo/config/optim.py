"""The optimizer-side recipe schema (``policy.megatron_cfg.{optimizer, scheduler,
distributed_data_parallel_config}``): Megatron-Core's optimizer, LR scheduler and DDP, with
NeMo-RL's key names. Re-exported by ``megatron_grpo.config.schema``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class OptimizerConfig:
    """Megatron-Core's optimizer (``get_megatron_optimizer``), NeMo-RL's ``policy.megatron_cfg.optimizer``."""

    optimizer: str = "adam"
    """adam (AdamW: decoupled weight decay) or sgd."""
    lr: float = 1e-6
    """Peak learning rate (the write-up: 1e-6 on Qwen3-0.6B)."""
    min_lr: float = 0.0
    """Learning rate at the end of a linear / cosine decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay (not applied to norms)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """sgd only: momentum."""
    clip_grad: float = 1.0
    """Global gradient-norm clip over the whole model (0 = off)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state (fp32 main params and moments) over data-parallel ranks (ZeRO-1):
    gradients are reduce-scattered and updated parameters all-gathered."""

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"policy.megatron_cfg.optimizer.optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.lr <= 0:
            raise ValueError(f"policy.megatron_cfg.optimizer.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"policy.megatron_cfg.optimizer.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.clip_grad < 0:
            raise ValueError(f"policy.megatron_cfg.optimizer.clip_grad must be >= 0, got {self.clip_grad}")


@dataclass
class SchedulerConfig:
    """Learning-rate schedule (Megatron's ``OptimizerParamScheduler``), NeMo-RL's ``policy.megatron_cfg.scheduler``."""

    lr_decay_style: str = "constant"
    """constant, linear or cosine (from lr down to min_lr over lr_decay_iters)."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warmup from lr_warmup_init to lr."""
    lr_warmup_init: float = 0.0
    """Learning rate at the first warmup step."""
    lr_decay_iters: Optional[int] = None
    """Optimizer steps of the decay (null = grpo.max_num_steps)."""

    def __post_init__(self):
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"policy.megatron_cfg.scheduler.lr_decay_style must be constant, linear or cosine, "
                             f"got {self.lr_decay_style!r}")
        if self.lr_warmup_iters < 0 or (self.lr_decay_iters is not None and self.lr_decay_iters < 1):
            raise ValueError("policy.megatron_cfg.scheduler: lr_warmup_iters must be >= 0 and lr_decay_iters >= 1")


@dataclass
class DDPConfig:
    """Megatron-Core's ``DistributedDataParallel`` (NeMo-RL's
    ``policy.megatron_cfg.distributed_data_parallel_config``). Gradients are summed over
    data-parallel ranks (the loss is a global token mean), in buckets."""

    grad_reduce_in_fp32: bool = True
    """Keep the gradient buffers (and their reduction) in fp32 for half params."""
    overlap_grad_reduce: bool = False
    """Start each bucket's reduction during the backward, as soon as its gradients are ready."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather updated params during the next forward."""
    bucket_size: Optional[int] = None
    """Elements per gradient bucket (null = Megatron's default: max(40M, 1M x DP) with DP > 1)."""
    check_for_nan_in_grad: bool = False
    """Raise on NaN/Inf in a gradient during its reduction (otherwise the step is skipped)."""
