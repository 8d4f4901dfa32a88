"""Ratio sources: where the PPO importance ratio's *value* comes from.

Every source returns ``r`` with shape ``[B, T]`` whose gradient flows through the
trainer's log-probs (``exp(lp - lp.detach())`` carries d lp and has value 1), so the
loss's gradient path is the same whatever the value; only the value changes, and with
it which tokens the clip decides to zero.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

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


@RATIO_SOURCES.register("gap_scaled")
def gap_scaled_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, shadow_log_probs: Optional[torch.Tensor],
                     gap_scale: Union[float, torch.Tensor] = 1.0) -> torch.Tensor:
    """Research knob (not a fix): r = exp(alpha + k * beta) in value, alpha = shadow - old (the policy change
    at the generator's precision), beta = log_probs - shadow (the precision gap), k = ``gap_scale`` (a number
    or one per token); gradient d log_probs as every source. k = 1 is ``train``, k = 0 is ``shadow``: a small
    model, whose gap is small, is studied at a larger model's gap without changing what it learns from."""
    if shadow_log_probs is None:
        raise ValueError("loss_fn.ratio='gap_scaled' needs shadow_log_probs (the low-precision shadow forward)")
    shadow = shadow_log_probs.detach()
    value = torch.exp(clamp_log_ratio(shadow - old_log_probs + gap_scale * (log_probs.detach() - shadow)))
    return value * _grad_carrier(log_probs)


shadow_ratio.value_reads_log_probs = False
one_ratio.value_reads_log_probs = False
"""The ratio's value ignores ``log_probs`` (given the shadow's): ``value_reads_log_probs``."""

gap_scaled_ratio.takes_gap_scale = True
"""The loss passes ``loss_fn.gap_scale`` (per token with ``gap_scale_by_logprob``) as a fourth argument."""


def gap_scale_of(generator_log_probs: torch.Tensor, scale: float,
                 by_logprob: Optional[Sequence[Sequence[float]]]) -> Union[float, torch.Tensor]:
    """``gap_scaled``'s k: ``scale`` for every token, or per token from ``by_logprob`` = ``[[lp_max, k], ...]``
    (ascending lp_max): a token whose generator log-prob is <= lp_max takes the first such k, a token above
    every lp_max takes ``scale`` (the rarity-shaped k_t of issue 34 item 5)."""
    if not by_logprob:
        return scale
    k = torch.full_like(generator_log_probs, float(scale))
    for lp_max, value in reversed(list(by_logprob)):
        k = torch.where(generator_log_probs <= lp_max, torch.full_like(k, float(value)), k)
    return k


def value_reads_log_probs(name: str) -> bool:
    """Whether source ``name``'s ratio *value* depends on the trainer's log-probs when the shadow's are given
    (``train``, ``gap_scaled``; not ``shadow``, ``one``). Undeclared sources count as reading them: the
    ``detach_center`` pre-pass then runs, which is always exact."""
    return getattr(get_ratio_source(name), "value_reads_log_probs", True)


def get_ratio_source(name: str):
    """The ratio function registered as ``name``."""
    return RATIO_SOURCES.get(name)
