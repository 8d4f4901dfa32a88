"""Advantage estimators (registry), GRPO's group-normalised advantage first."""

from __future__ import annotations

import torch

from megatron_grpo.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``[N]`` (float64) from rewards ``[N]`` ordered group by group.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased std of the group
    (``scale="std"``, GRPO), or ``A_i = r_i - mean_g`` (``scale="none"``, Dr. GRPO).
    Computed in float64, and a group whose rewards are all equal (max == min, a group of
    size 1 included) gets exactly A = 0: in float32 the mean of 8 x 0.7 is one ulp off and
    dividing that by std + eps = 1e-6 gave every member the same non-zero advantage. The
    loss casts to float32 where it multiplies.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size={group_size} does not divide the number of rewards {rewards.numel()}")
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    grouped = rewards.to(torch.float64).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "std" and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred).reshape(-1)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: centred and divided by the group's std."""
    return grpo_advantages(rewards, group_size, scale="std")


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: centred only."""
    return grpo_advantages(rewards, group_size, scale="none")


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i minus the mean of the other group members."""
    if group_size < 2:
        raise ValueError("advantage estimator 'rloo' needs group_size >= 2")
    centred = grpo_advantages(rewards, group_size, scale="none")
    return centred * group_size / (group_size - 1)
