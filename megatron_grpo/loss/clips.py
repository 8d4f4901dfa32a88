"""Clip variants: how the ratio and the advantage become a per-token loss.

Each variant is a class with two static methods:
``loss(ratio, adv, log_probs, cfg, center) -> [B, T]`` and
``zero_grad(ratio_value, adv, cfg) -> bool [B, T]``, the tokens whose gradient from
this term is exactly zero because the clip decided so (tokens with A == 0 have no
gradient under any variant and are not counted). A variant with ``needs_center = True``
gets ``center``: the mean of its detached weight over the valid tokens of the *whole*
global batch (all micro-batches, all data-parallel ranks), computed before the schedule.
"""

from __future__ import annotations

import torch

from megatron_grpo.registry import Registry

CLIP_VARIANTS = Registry("clip variant")


def clamp_ratio(ratio: torch.Tensor, cfg) -> torch.Tensor:
    """clamp(r, max(0, 1 - eps_low), 1 + eps_high): eps_low >= 1 (the write-up's eps = 10) leaves
    the ratio unbounded below, its natural floor 0."""
    return ratio.clamp(max(0.0, 1.0 - cfg.ratio_clip_min), 1.0 + cfg.ratio_clip_max)


def outside_region(ratio_value: torch.Tensor, cfg) -> torch.Tensor:
    """Ratio outside the trust region [1 - eps_low, 1 + eps_high] (direction-blind)."""
    return (ratio_value < 1.0 - cfg.ratio_clip_min) | (ratio_value > 1.0 + cfg.ratio_clip_max)


def ppo_clipped(ratio_value: torch.Tensor, adv: torch.Tensor, cfg) -> torch.Tensor:
    """Tokens where PPO's clamped branch strictly wins: A > 0 and r > 1+eps_high, or A < 0 and r < 1-eps_low."""
    return ((adv > 0) & (ratio_value > 1.0 + cfg.ratio_clip_max)) | ((adv < 0) & (ratio_value < 1.0 - cfg.ratio_clip_min))


def ppo_weight(ratio: torch.Tensor, adv: torch.Tensor, cfg) -> torch.Tensor:
    """W = min(r*A, clamp(r)*A), the PPO surrogate per token."""
    return torch.minimum(ratio * adv, clamp_ratio(ratio, cfg) * adv)


@CLIP_VARIANTS.register("ppo")
class PPOClip:
    """-min(r*A, clamp(r, 1-eps_low, 1+eps_high)*A)."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None) -> torch.Tensor:
        return -ppo_weight(ratio, adv, cfg)

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return ppo_clipped(ratio_value, adv, cfg)


@CLIP_VARIANTS.register("none")
class NoClip:
    """-r*A: the unclipped importance-sampled policy gradient."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None) -> torch.Tensor:
        return -ratio * adv

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return torch.zeros_like(adv, dtype=torch.bool)


@CLIP_VARIANTS.register("detach")
class DetachClip:
    """-W.detach() * log_probs with W = min(r*A, clamp(r)*A): every token keeps a gradient."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None) -> torch.Tensor:
        return -ppo_weight(ratio, adv, cfg).detach() * log_probs

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return torch.zeros_like(adv, dtype=torch.bool)


@CLIP_VARIANTS.register("detach_center")
class DetachCenterClip:
    """As ``detach``, with W minus mu_W, its mean over the valid tokens of the global batch."""

    needs_center = True

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None) -> torch.Tensor:
        if center is None:
            raise ValueError("loss_fn.clip=detach_center needs the global mean of W (center)")
        weight = ppo_weight(ratio, adv, cfg).detach()
        return -(weight - center.to(weight.dtype)) * log_probs

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return torch.zeros_like(adv, dtype=torch.bool)


def get_clip_variant(name: str):
    """The clip variant class registered as ``name``."""
    return CLIP_VARIANTS.get(name)
