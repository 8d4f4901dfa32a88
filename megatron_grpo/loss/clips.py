"""Clip variants: how the ratio and the advantage become a per-token loss.

Each variant is a class with two static methods:
``loss(ratio, adv, log_probs, cfg, token_mean) -> [B, T]`` and
``zero_grad(ratio_value, adv, cfg) -> bool [B, T]``, the tokens whose gradient from
this term is exactly zero because the clip decided so (tokens with A == 0 have no
gradient under any variant and are not counted).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_grpo.registry import Registry

CLIP_VARIANTS = Registry("clip variant")


def clamp_ratio(ratio: torch.Tensor, cfg) -> torch.Tensor:
    """clamp(r, 1 - eps_low, 1 + eps_high)."""
    return ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def outside_region(ratio_value: torch.Tensor, cfg) -> torch.Tensor:
    """Ratio outside the trust region [1 - eps_low, 1 + eps_high] (direction-blind)."""
    return (ratio_value < 1.0 - cfg.ratio_clip_min) | (ratio_value > 1.0 + cfg.ratio_clip_max)


def ppo_clipped(ratio_value: torch.Tensor, adv: torch.Tensor, cfg) -> torch.Tensor:
    """Tokens where PPO's clamped branch strictly wins: A > 0 and r > 1+eps_high, or A < 0 and r < 1-eps_low."""
    return ((adv > 0) & (ratio_value > 1.0 + cfg.ratio_clip_max)) | ((adv < 0) & (ratio_value < 1.0 - cfg.ratio_clip_min))


def _ppo_weight(ratio: torch.Tensor, adv: torch.Tensor, cfg) -> torch.Tensor:
    return torch.minimum(ratio * adv, clamp_ratio(ratio, cfg) * adv)


@CLIP_VARIANTS.register("ppo")
class PPOClip:
    """-min(r*A, clamp(r, 1-eps_low, 1+eps_high)*A)."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, token_mean: Callable) -> torch.Tensor:
        return -_ppo_weight(ratio, adv, cfg)

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return ppo_clipped(ratio_value, adv, cfg)


@CLIP_VARIANTS.register("none")
class NoClip:
    """-r*A: the unclipped importance-sampled policy gradient."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, token_mean: Callable) -> torch.Tensor:
        return -ratio * adv

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return torch.zeros_like(adv, dtype=torch.bool)


@CLIP_VARIANTS.register("detach")
class DetachClip:
    """-W.detach() * log_probs with W = min(r*A, clamp(r)*A): every token keeps a gradient."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, token_mean: Callable) -> torch.Tensor:
        return -_ppo_weight(ratio, adv, cfg).detach() * log_probs

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return torch.zeros_like(adv, dtype=torch.bool)


@CLIP_VARIANTS.register("detach_center")
class DetachCenterClip:
    """As ``detach``, with W minus its token mean (over the valid tokens of the call, all DP ranks)."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, token_mean: Callable) -> torch.Tensor:
        weight = _ppo_weight(ratio, adv, cfg).detach()
        return -(weight - token_mean(weight)) * log_probs

    @staticmethod
    def zero_grad(ratio_value, adv, cfg) -> torch.Tensor:
        return torch.zeros_like(adv, dtype=torch.bool)


def get_clip_variant(name: str):
    """The clip variant class registered as ``name``."""
    return CLIP_VARIANTS.get(name)
