"""The optimizer behind one interface: AdamW on fp32 master weights, dynamic loss scaling for fp16.

Megatron's own optimizers hard-code CUDA tensors in 0.16.1; on CPU this module gives the
same behaviour (fp32 master copies of half-precision weights, grad clipping across TP,
a dynamic loss scaler for fp16 that skips steps with inf/NaN gradients).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_grpo.config import OptimizerConfig, PrecisionConfig
from megatron_grpo.parallel import grads as grad_utils


class DynamicLossScaler:
    """Scales the loss up; halves on overflow, doubles after ``window`` clean steps."""

    def __init__(self, initial: float, minimum: float, window: int):
        self.scale, self.minimum, self.window, self.clean_steps = float(initial), float(minimum), int(window), 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean_steps = max(self.scale / 2, self.minimum), 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale, self.clean_steps = self.scale * 2, 0

    def state_dict(self) -> Dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: Dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


class Optimizer:
    """AdamW over the model's parameters, with fp32 master weights when the params are half."""

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig, precision: PrecisionConfig):
        self.cfg = cfg
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        grad_utils.tag_expert_params(self.named)
        self.params: List[torch.nn.Parameter] = [p for _, p in self.named]
        self.half = any(p.dtype != torch.float32 for p in self.params)
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params] if self.half else self.params
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.adam = torch.optim.AdamW(self.master, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        fp16 = precision.params_dtype == "float16" or precision.compute_dtype == "float16"
        self.scaler = (DynamicLossScaler(precision.initial_loss_scale, precision.min_loss_scale,
                                         precision.loss_scale_window) if fp16 else None)

    def master_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 tensor the optimizer updates for ``param`` (the param itself unless half)."""
        return self.master[self._index[id(param)]] if self.half else param

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        """AdamW's ``exp_avg`` / ``exp_avg_sq`` of ``param`` (zeros before the first step)."""
        master = self.master_of(param)
        state = self.adam.state.get(master)
        return state[key] if state and key in state else torch.zeros_like(master, dtype=torch.float32)

    def adam_step(self) -> int:
        steps = [int(st["step"]) for st in self.adam.state.values() if "step" in st]
        return max(steps, default=0)

    def init_state(self, step: int) -> None:
        """Creates AdamW state (zero moments at ``step``) for every parameter, to be filled by a load."""
        for m in self.master:
            self.adam.state[m] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(m, dtype=torch.float32),
                                  "exp_avg_sq": torch.zeros_like(m, dtype=torch.float32)}

    def sync_params_from_master(self) -> None:
        if self.half:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m.to(p.dtype))

    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.half:
            for m in self.master:
                m.grad = None

    def reduce_gradients(self) -> None:
        """Sums gradients over DP (and partial TP grads over TP); ``step`` does it unless told it is done."""
        grad_utils.all_reduce_gradients(self.named)

    def step(self, reduced: bool = False) -> Dict[str, torch.Tensor]:
        """Reduces grads over DP, unscales, clips, steps (unless non-finite). Returns grad-norm metrics.

        A non-finite gradient skips the step. With fp16 loss scaling that is the scaler's normal
        back-off (``train/skipped_overflow``) while the scale is above its minimum; only at the
        minimum scale does it count as a non-finite skip (``train/skipped_nonfinite``), which
        ``grpo.max_consecutive_skips`` limits."""
        if not reduced:
            self.reduce_gradients()
        scale = self.loss_scale()
        if scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(scale)
        norm = grad_utils.global_grad_norm(self.params)
        finite = bool(torch.isfinite(norm))  # one host sync per step: decides whether to step
        overflow = not finite and self.scaler is not None and self.scaler.scale > self.scaler.minimum
        if self.scaler is not None:
            self.scaler.update(not finite)
        flags = {"train/skipped_nonfinite": torch.tensor(float(not finite and not overflow), device=norm.device),
                 "train/skipped_overflow": torch.tensor(float(overflow), device=norm.device)}
        if not finite:
            self.zero_grad()
            return {"train/grad_norm": norm.float(), **flags}
        grad_utils.clip_gradients(self.params, self.cfg.clip_grad, norm)
        if self.half:
            for p, m in zip(self.params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
        self.adam.step()
        if self.half:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m.to(p.dtype))
        return {"train/grad_norm": norm.float(), **flags}

    def state_dict(self) -> Dict:
        return {"adam": self.adam.state_dict(), "master": [m.detach().clone() for m in self.master] if self.half else None,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: Dict) -> None:
        self.adam.load_state_dict(state["adam"])
        if self.half and state.get("master") is not None:
            with torch.no_grad():
                for m, saved in zip(self.master, state["master"]):
                    m.copy_(saved)
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
