"""Megatron-Core's DDP, optimizer and LR scheduler: the one training path, on CPU and GPU.

- ``wrap_model``: ``megatron.core.distributed.DistributedDataParallel`` (bucketed gradient
  buffers in ``param.main_grad``, reduced over data parallelism, optionally overlapped with the
  backward; reduce-scattered for the distributed optimizer).
- ``Optimizer``: ``get_megatron_optimizer`` (fp32 params; bf16/fp16 params with fp32 main
  params; fp16 dynamic loss scaling; the distributed optimizer) and ``OptimizerParamScheduler``.
- ``configure_schedule``: the hooks Megatron's pipeline schedules call (``finalize_model_grads``,
  loss scaling, ``no_sync`` / grad and param sync for overlap).

Losses are already normalised by the *global* valid-token count, so gradients are summed over
data-parallel ranks (``calculate_per_token_loss=True``: DDP's scaling factor is 1) and
``finalize_model_grads`` runs without its division by the token count. The CPU spots of
Megatron's optimizers are shimmed in ``parallel/cpu.py`` only. Megatron's gloo data-parallel groups
exist on CPU only (``parallel/state.py``): the optimizer is told whether they do.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_grpo.config.schema import Config, to_dtype
from megatron_grpo.models import model_chunks, unwrap
from megatron_grpo.models.forward import model_device
from megatron_grpo.parallel.cpu import fuse_torch_adam, fuse_wgrad_accumulation
from megatron_grpo.parallel.state import has_gloo_groups


def ddp_config(cfg: Config):
    """Megatron's ``DistributedDataParallelConfig`` for the recipe. Without master weights the
    gradient buffers are in the params' dtype (the optimizer updates the params with them)."""
    m, p = cfg.policy.megatron_cfg, cfg.policy.precision
    d = m.distributed_data_parallel_config
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32 and p.master_weights,
        overlap_grad_reduce=d.overlap_grad_reduce, overlap_param_gather=d.overlap_param_gather,
        use_distributed_optimizer=m.optimizer.use_distributed_optimizer, bucket_size=d.bucket_size,
        check_for_nan_in_grad=d.check_for_nan_in_grad)


def wrap_model(model, cfg: Config):
    """This rank's model (a ``GPTModel``, possibly in ``Float16Module``) inside Megatron's DDP; on CPU with
    Megatron's weight-gradient accumulation fusion (``parallel.cpu.fuse_wgrad_accumulation``). A list of
    model chunks (interleaved virtual stages) gives the list of their DDPs, the chunks after the first in
    one bucket each (Megatron-LM's ``get_model``: their gradients are ready at different times)."""
    wrapped = []
    for index, chunk in enumerate(model_chunks(model)):
        ddp = DistributedDataParallel(config=unwrap(chunk).config, ddp_config=ddp_config(cfg), module=chunk,
                                      disable_bucketing=index > 0)
        fuse_wgrad_accumulation(ddp)
        wrapped.append(ddp)
    return wrapped if isinstance(model, (list, tuple)) else wrapped[0]


def optimizer_config(cfg: Config):
    """Megatron's ``OptimizerConfig`` for the recipe (NeMo-RL's ``megatron_cfg.optimizer`` keys)."""
    o, p = cfg.policy.megatron_cfg.optimizer, cfg.policy.precision
    params_dtype = to_dtype(p.params_dtype)
    return OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, sgd_momentum=o.sgd_momentum, clip_grad=o.clip_grad,
        bf16=p.master_weights and params_dtype == torch.bfloat16, fp16=uses_loss_scaler(cfg),
        params_dtype=params_dtype, initial_loss_scale=p.initial_loss_scale, min_loss_scale=p.min_loss_scale,
        loss_scale_window=p.loss_scale_window, hysteresis=p.hysteresis,
        use_distributed_optimizer=o.use_distributed_optimizer,
        overlap_param_gather=cfg.policy.megatron_cfg.distributed_data_parallel_config.overlap_param_gather)


def uses_loss_scaler(cfg: Config) -> bool:
    """fp16 params or fp16 compute (autocast over fp32 params): Megatron's mixed-precision
    optimizer with its dynamic loss scaler (fp32 params are used as their own main params)."""
    p = cfg.policy.precision
    return p.master_weights and "float16" in (p.params_dtype, p.compute_dtype)


def finalize_grads(model_chunks, num_tokens=None, **kwargs) -> None:
    """Megatron's ``finalize_model_grads`` (DP / expert-DP reduction, TP-partial QK-norm and
    sequence-parallel grads, embedding ties across PP stages) without the division by the token
    count: our losses are already global token means."""
    finalize_model_grads(model_chunks, None, **kwargs)


def configure_schedule(model, optimizer: "Optimizer", cfg: Config) -> None:
    """Sets the hooks Megatron's schedules read from the model config (one config object, shared by every
    chunk; the interleaved schedule takes a list of per-chunk hooks, as Megatron-LM's ``train`` sets them)."""
    chunks, d = model_chunks(model), cfg.policy.megatron_cfg.distributed_data_parallel_config
    config = unwrap(chunks[0]).config
    hooks = (lambda name: [getattr(c, name) for c in chunks]) if len(chunks) > 1 else \
        (lambda name: getattr(chunks[0], name))
    config.finalize_model_grads_func = finalize_grads
    config.grad_scale_func = optimizer.megatron.scale_loss if optimizer.has_loss_scaler else None
    config.no_sync_func = hooks("no_sync")
    config.grad_sync_func = hooks("start_grad_sync") if d.overlap_grad_reduce else None
    config.param_sync_func = hooks("start_param_sync") if d.overlap_param_gather else None


class Optimizer:
    """Megatron's optimizer and LR scheduler for a DDP-wrapped model, with the trainer's skip policy:
    a non-finite gradient skips the update. With fp16 loss scaling that is the scaler's back-off
    (``train/skipped_overflow``) while the scale is above its minimum; otherwise it counts as a
    non-finite skip (``train/skipped_nonfinite``, limited by ``grpo.max_consecutive_skips``)."""

    def __init__(self, model, cfg: Config):
        self.model, self.cfg, self.chunks = model, cfg, model_chunks(model)
        # gloo groups exist on CPU only (parallel/state.py); Megatron's default assumes them
        self.megatron = get_megatron_optimizer(optimizer_config(cfg), self.chunks,
                                               use_gloo_process_groups=has_gloo_groups())
        fuse_torch_adam(self.chained)  # CPU: torch's fused AdamW kernel instead of its per-tensor loop
        o, s = cfg.policy.megatron_cfg.optimizer, cfg.policy.megatron_cfg.scheduler
        decay = s.lr_decay_iters or max(cfg.grpo.max_num_steps, s.lr_warmup_iters + 1)
        self.scheduler = OptimizerParamScheduler(
            self.megatron, init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_iters,
            lr_decay_steps=decay, lr_decay_style=s.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=decay, wd_incr_style="constant")
        self.has_loss_scaler = uses_loss_scaler(cfg)
        self.min_loss_scale = cfg.policy.precision.min_loss_scale
        configure_schedule(model, self, cfg)

    @property
    def chained(self) -> List:
        """The underlying optimizers (dense and, with experts, expert parameters)."""
        return list(getattr(self.megatron, "chained_optimizers", [self.megatron]))

    @property
    def params(self) -> List[torch.nn.Parameter]:
        """The model's trainable parameters (their reduced gradients are in ``main_grad``)."""
        return [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]

    def loss_scale(self) -> float:
        return float(self.megatron.get_loss_scale())

    def zero_grad(self) -> None:
        """Zeroes DDP's gradient buffers and the optimizer's main gradients."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.megatron.zero_grad()

    def step(self) -> Dict[str, torch.Tensor]:
        """Unscale + found-inf (fp16) -> global grad norm -> skip if non-finite, else clip and update
        (then the LR scheduler). Returns ``train/grad_norm``, ``train/lr`` and the skip flags."""
        device = model_device(self.chunks[0])
        scale_before = self.loss_scale()
        found_inf = self.megatron.prepare_grads()  # fp16: unscales, checks, updates the scaler
        norm = float("nan") if found_inf else float(self.megatron.get_grad_norm())
        finite = math.isfinite(norm)
        overflow = not finite and self.has_loss_scaler and scale_before > self.min_loss_scale
        lr = self.megatron.param_groups[0]["lr"]  # the rate this update uses
        if finite:
            self._clip(norm)
            self.megatron.step_with_ready_grads()
            self._sync_params()
            self.scheduler.step(increment=1)
        else:
            self.zero_grad()
        flag = lambda value: torch.tensor(float(value), device=device)  # noqa: E731
        return {"train/grad_norm": flag(norm), "train/lr": flag(lr),
                "train/skipped_nonfinite": flag(not finite and not overflow), "train/skipped_overflow": flag(overflow)}

    def _clip(self, norm: float) -> None:
        for opt in self.chained:
            params = opt.get_parameters()
            if opt.config.clip_grad <= 0 or not params or getattr(opt, "is_stub_optimizer", False):
                continue
            grads = [p.grad for p in params if p.grad is not None]
            if all(g.dtype == torch.float32 for g in grads):
                clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, norm,
                                             opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
            elif opt.config.clip_grad / (norm + 1.0e-6) < 1.0:  # master_weights=false: grads in the params' dtype
                torch._foreach_mul_(grads, opt.config.clip_grad / (norm + 1.0e-6))

    def _sync_params(self) -> None:
        """With ``overlap_param_gather`` the distributed optimizer leaves the all-gather of updated
        params to the next forward; the trainer reads them at once (shadow forward, weight push)."""
        if self.cfg.policy.megatron_cfg.distributed_data_parallel_config.overlap_param_gather:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: main params (when separate from the model's) and moments."""
        seen, total = set(), 0
        model_storage = {p.untyped_storage().data_ptr() for chunk in self.chunks for p in chunk.parameters()}
        for opt in self.chained:
            for state in opt.optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.dim() > 0 and id(value) not in seen:
                        seen.add(id(value))
                        total += value.numel() * value.element_size()
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in seen and param.untyped_storage().data_ptr() not in model_storage:
                        seen.add(id(param))
                        total += param.numel() * param.element_size()
        return total
