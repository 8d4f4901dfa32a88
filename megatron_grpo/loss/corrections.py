"""Off-policy corrections (verl's rollout correction, NeMo-RL's TIS/IcePop/seq-mask).

Each correction maps the detached trainer-vs-generator log-ratio ``[B, T]`` and the
mask to per-token weights ``[B, T]`` (fp32, no gradient); the loss only multiplies
its per-token terms by them.
"""

from __future__ import annotations

import torch

from megatron_grpo.loss.ratios import clamp_log_ratio
from megatron_grpo.registry import Registry

CORRECTIONS = Registry("correction")


@CORRECTIONS.register("tis")
def truncated_importance_sampling(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Token-level TIS: w = min(r, tis_cap)."""
    return torch.exp(clamp_log_ratio(log_ratio)).clamp(max=cfg.tis_cap)


@CORRECTIONS.register("icepop")
def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """IcePop: w = 1 for tokens with ratio in [icepop_low, icepop_high], else 0."""
    ratio = torch.exp(clamp_log_ratio(log_ratio))
    return ((ratio >= cfg.icepop_low) & (ratio <= cfg.icepop_high)).float()


@CORRECTIONS.register("seq_mask_tis")
def seq_mask_tis(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Sequence mask by geometric-mean ratio exp(mean_t log r) in [seq_mask_low, seq_mask_high], times token TIS."""
    maskf = mask.float()
    mean_log = (log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)
    geo = torch.exp(clamp_log_ratio(mean_log))
    keep = ((geo >= cfg.seq_mask_low) & (geo <= cfg.seq_mask_high)).float()
    return keep.unsqueeze(-1) * truncated_importance_sampling(log_ratio, mask, cfg)


def get_correction(name: str):
    """The correction function registered as ``name``."""
    return CORRECTIONS.get(name)
