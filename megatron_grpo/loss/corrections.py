"""Off-policy corrections (verl's rollout correction, NeMo-RL's TIS / seq-mask-TIS, IcePop).

Each correction maps the detached log-ratio ``log(pi_proximal / pi_rollout)`` ``[B, T]`` and
the mask to per-token weights ``[B, T]`` (fp32, no gradient): an importance weight times a
keep mask. The loss only multiplies its per-token terms by them. How the weights are used
depends on ``loss_fn.correction_mode`` (``policy.correction_weights``): ``decoupled``
multiplies by the whole weight (the PPO ratio is then against the proximal policy);
``bypass`` multiplies only by the keep mask (the PPO ratio is against the generator and
already carries the importance weight).
"""

from __future__ import annotations

import torch

from megatron_grpo.loss.ratios import clamp_log_ratio
from megatron_grpo.registry import Registry

CORRECTIONS = Registry("correction")

MASK_ONLY = frozenset({"token_k1"})
"""Corrections whose weight is a pure 0/1 mask (usable in either mode)."""
WEIGHT_ONLY = frozenset({"tis"})
"""Corrections that never mask a token: no effect in ``bypass`` mode."""


@CORRECTIONS.register("tis")
def truncated_importance_sampling(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Token-level TIS (verl ``rollout_is=token``): w = min(r, tis_cap), r = exp(log_ratio)."""
    return torch.exp(clamp_log_ratio(log_ratio)).clamp(max=cfg.tis_cap)


def _in_band(log_ratio: torch.Tensor, cfg) -> torch.Tensor:
    ratio = torch.exp(clamp_log_ratio(log_ratio))
    return (ratio >= cfg.icepop_low) & (ratio <= cfg.icepop_high)


@CORRECTIONS.register("icepop")
def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """IcePop (Ring / Ling team): w = r for tokens with r in [icepop_low, icepop_high], else 0
    (the kept tokens are importance-weighted, the rest masked)."""
    return torch.where(_in_band(log_ratio, cfg), torch.exp(clamp_log_ratio(log_ratio)), torch.zeros_like(log_ratio))


@CORRECTIONS.register("token_k1")
def token_k1(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Token-level rejection (verl ``rollout_rs=token_k1``): w = 1 for tokens with r in
    [icepop_low, icepop_high], else 0; no importance weight. verl bounds pi_rollout / pi_train
    (k1 = -log r); here the bounds are on r = pi_train / pi_rollout: the same for symmetric
    bounds (low = 1 / high)."""
    return _in_band(log_ratio, cfg).float()


@CORRECTIONS.register("seq_mask_tis")
def seq_mask_tis(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Sequence mask by geometric-mean ratio exp(mean_t log r) in [seq_mask_low, seq_mask_high]
    (NeMo-RL's seq-mask-TIS, verl's ``seq_mean_k1`` rejection), times token TIS."""
    maskf = mask.float()
    mean_log = (log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)
    geo = torch.exp(clamp_log_ratio(mean_log))
    keep = ((geo >= cfg.seq_mask_low) & (geo <= cfg.seq_mask_high)).float()
    return keep.unsqueeze(-1) * truncated_importance_sampling(log_ratio, mask, cfg)


def get_correction(name: str):
    """The correction function registered as ``name``."""
    return CORRECTIONS.get(name)
