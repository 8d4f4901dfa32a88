"""Policy-loss families (``loss_fn.clip``): how the ratio and the advantage become a per-token loss,
and which tokens each family gates.

Every family is a ``PolicyLoss`` subclass with static methods:

- ``loss(ratio, adv, log_probs, cfg, center, mask) -> [B, T]``: the per-token loss (aggregated
  by ``loss_fn.aggregation``);
- ``gate_value(ratio_value, mask) -> [B, T]``: the ratio at the level the family gates, token
  (the ratio itself) or sequence (each token holds its sequence's ratio);
- ``zero_grad(value, adv, cfg) -> bool [B, T]``: the tokens whose gradient is exactly zero
  because the family's gate decided so at ratio ``value`` (tokens with A == 0 have no gradient
  under any family and are not counted);
- ``truncated(value, adv, cfg) -> bool [B, T]``: the tokens whose gradient weight the family
  truncates (bounded, not zeroed), e.g. CISPO's clipped IS weight.

The phantom / legit / rescued metrics (``loss.metrics.clip_stats``) are computed from these
declarations, once for the actual ratio and once for the clean (shadow) ratio, never per
family. A family with ``needs_center = True`` gets ``center``: the mean of its detached weight
over the valid tokens of the *whole* global batch, computed before the schedule.
"""

from __future__ import annotations

import torch

from megatron_grpo.registry import Registry

CLIP_VARIANTS = Registry("policy loss (loss_fn.clip)")

GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's sequence log-ratio is capped at 10 (as verl), so exp() stays finite."""


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


def _none(value: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(value, dtype=torch.bool)


class PolicyLoss:
    """Defaults: token-level gate, nothing zeroed or truncated, no centring."""

    level = "token"
    needs_center = False

    @staticmethod
    def gate_value(ratio_value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ratio_value

    @staticmethod
    def zero_grad(value, adv, cfg) -> torch.Tensor:
        return _none(value)

    @staticmethod
    def truncated(value, adv, cfg) -> torch.Tensor:
        return _none(value)


@CLIP_VARIANTS.register("ppo")
class PPOClip(PolicyLoss):
    """-min(r*A, clamp(r, 1-eps_low, 1+eps_high)*A); with ``ratio_clip_c = c`` (dual clip, verl's
    ``clip_ratio_c``) the loss of A < 0 tokens is also bounded: min(that, -A*c)."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None, mask=None) -> torch.Tensor:
        loss = -ppo_weight(ratio, adv, cfg)
        if cfg.ratio_clip_c is None:
            return loss
        return torch.where(adv < 0, torch.minimum(loss, -adv * cfg.ratio_clip_c), loss)

    @staticmethod
    def zero_grad(value, adv, cfg) -> torch.Tensor:
        zero = ppo_clipped(value, adv, cfg)
        if cfg.ratio_clip_c is not None:  # dual clip: the constant -A*c wins when r > c
            zero = zero | ((adv < 0) & (value > cfg.ratio_clip_c))
        return zero


@CLIP_VARIANTS.register("none")
class NoClip(PolicyLoss):
    """-r*A: the unclipped importance-sampled policy gradient."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None, mask=None) -> torch.Tensor:
        return -ratio * adv


@CLIP_VARIANTS.register("detach")
class DetachClip(PolicyLoss):
    """-W.detach() * log_probs with W = min(r*A, clamp(r)*A): every token keeps a gradient."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None, mask=None) -> torch.Tensor:
        return -ppo_weight(ratio, adv, cfg).detach() * log_probs


@CLIP_VARIANTS.register("detach_center")
class DetachCenterClip(PolicyLoss):
    """As ``detach``, with W minus mu_W, its mean over the valid tokens of the global batch."""

    needs_center = True

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None, mask=None) -> torch.Tensor:
        if center is None:
            raise ValueError("loss_fn.clip=detach_center needs the global mean of W (center)")
        weight = ppo_weight(ratio, adv, cfg).detach()
        return -(weight - center.to(weight.dtype)) * log_probs


def sequence_ratio(ratio_value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i = exp(mean over the valid tokens of sequence i of log r_t), broadcast to ``[B, T]``
    (1 for a sequence without valid tokens)."""
    maskf = mask.to(torch.float32)
    log_r = torch.log(ratio_value.detach().float().clamp(min=1e-30)) * maskf
    mean = log_r.sum(-1) / maskf.sum(-1).clamp(min=1.0)
    return torch.exp(mean.clamp(max=GSPO_LOG_RATIO_MAX)).unsqueeze(-1).expand_as(ratio_value)


@CLIP_VARIANTS.register("gspo")
class GSPOClip(PolicyLoss):
    """GSPO (Qwen; GSPO-token form): s_it = sg(s_i) * r_t / sg(r_t), with s_i = exp(mean_t log r_t);
    loss -min(s_it*A, clamp(s_it, 1-eps_low, 1+eps_high)*A). The value is the sequence ratio,
    the gradient of token t is s_i * A * d log p_t; whole sequences are clipped. The paper uses
    eps ~ 3e-4 / 4e-4 and ``aggregation: seq_mean_token_mean`` (verl forces that aggregation;
    here it is the recipe's choice)."""

    level = "sequence"

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None, mask=None) -> torch.Tensor:
        seq = sequence_ratio(ratio, mask)
        s_tok = seq * (ratio / ratio.detach().clamp(min=1e-30))
        return -ppo_weight(s_tok, adv, cfg)

    @staticmethod
    def gate_value(ratio_value, mask) -> torch.Tensor:
        return sequence_ratio(ratio_value, mask)

    @staticmethod
    def zero_grad(value, adv, cfg) -> torch.Tensor:
        return ppo_clipped(value, adv, cfg)


@CLIP_VARIANTS.register("cispo")
class CISPOClip(PolicyLoss):
    """CISPO (MiniMax-M1): -sg(clamp(r, 1-eps_low, 1+eps_high)) * A * log p. No token loses its
    gradient; the IS weight is truncated instead. verl clips both sides (as here); MiniMax-M1
    clips only above: set ``ratio_clip_min`` >= 1 for that."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None, mask=None) -> torch.Tensor:
        return -clamp_ratio(ratio.detach(), cfg) * adv * log_probs

    @staticmethod
    def truncated(value, adv, cfg) -> torch.Tensor:
        return outside_region(value, cfg) & (adv != 0)


def _sapo_tau(adv: torch.Tensor, cfg) -> torch.Tensor:
    return torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))


@CLIP_VARIANTS.register("sapo")
class SAPOClip(PolicyLoss):
    """SAPO (Qwen; verl's ``sapo``): a soft gate instead of a hard clip,
    loss = -A * sigmoid(tau*(r - 1)) * 4/tau, tau = sapo_tau_pos for A > 0, sapo_tau_neg otherwise.
    Its gradient is A * r * g(r) * d log p with g = 4 sigma(1 - sigma) (1 at r = 1): never exactly
    zero; tokens where g < 1/2 (gradient more than halved) count as truncated."""

    @staticmethod
    def loss(ratio, adv, log_probs, cfg, center=None, mask=None) -> torch.Tensor:
        tau = _sapo_tau(adv, cfg)
        return -adv * torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau

    @staticmethod
    def truncated(value, adv, cfg) -> torch.Tensor:
        sig = torch.sigmoid(_sapo_tau(adv, cfg) * (value - 1.0))
        return (4.0 * sig * (1.0 - sig) < 0.5) & (adv != 0)


def get_clip_variant(name: str):
    """The policy-loss class registered as ``name``."""
    return CLIP_VARIANTS.get(name)
