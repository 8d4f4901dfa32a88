"""Ratio sources: where the PPO importance ratio's *value* comes from.

Every source returns ``r`` with shape ``[B, T]`` whose gradient flows through the
trainer's log-probs (``exp(lp - lp.detach())`` carries d lp and has value 1), so the
loss's gradient path is the same whatever the value; only the value changes, and with
it which tokens the clip decides to zero.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_grpo.registry import Registry

RATIO_SOURCES = Registry("ratio source")

LOG_RATIO_CLAMP = 20.0
"""Ratio *values* use log-ratios clamped to +-20 before ``exp``: exp(20) ~ 4.9e8 is far past
any clip boundary, and without it a single token whose log-prob diverged (e.g. a rare token
under a mismatched precision) gives inf * 0 = NaN in the loss. The clamp acts on the value
only: the gradient always flows through ``_grad_carrier`` (d r = r_clamped * d log_probs),
so no token's gradient is silently zeroed by it."""


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """Clamps a log-ratio to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _grad_carrier(log_probs: torch.Tensor) -> torch.Tensor:
    """Value 1, gradient d log_probs."""
    return torch.exp(log_probs - log_probs.detach())


@RATIO_SOURCES.register("train")
def train_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, shadow_log_probs: Optional[torch.Tensor]) -> torch.Tensor:
    """r = exp(log_probs - old_log_probs): precision gap beta included (value clamped, gradient kept)."""
    value = torch.exp(clamp_log_ratio(log_probs.detach() - old_log_probs))
    return value * _grad_carrier(log_probs)


@RATIO_SOURCES.register("shadow")
def shadow_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, shadow_log_probs: Optional[torch.Tensor]) -> torch.Tensor:
    """r = exp(shadow - old) * exp(lp - lp.detach()): value without beta, gradient from the trainer."""
    if shadow_log_probs is None:
        raise ValueError("loss_fn.ratio='shadow' needs shadow_log_probs (the low-precision shadow forward)")
    value = torch.exp(clamp_log_ratio(shadow_log_probs.detach() - old_log_probs))
    return value * _grad_carrier(log_probs)


@RATIO_SOURCES.register("one")
def one_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, shadow_log_probs: Optional[torch.Tensor]) -> torch.Tensor:
    """r = 1 in value (REINFORCE), gradient d log_probs."""
    return _grad_carrier(log_probs)


def get_ratio_source(name: str):
    """The ratio function registered as ``name``."""
    return RATIO_SOURCES.get(name)
