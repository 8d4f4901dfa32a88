"""Rollout corrections (verl's rollout correction, NeMo-RL's TIS / IcePop / seq-mask-TIS, TRL's MIS).

Each correction maps the detached per-token log-ratio ``lr = log(pi_proximal / pi_rollout)``
``[B, T]`` and the mask to ``(weight, raw)``, both ``[B, T]`` fp32 without gradient: ``weight``
is what multiplies the per-token loss (an importance weight times a keep mask), ``raw`` the
importance weight before truncation or masking (1 for pure rejection), for the logged
pre-truncation statistics. ``loss_fn.correction`` may name several, comma-separated (e.g.
``tis,seq_mean_k3``): their weights multiply. How the weights meet the PPO ratio is
``loss_fn.correction_mode``'s business (``policy.correction_weights``).

Importance weights: token r_t = exp(lr_t); sequence s_i = exp(sum_t lr_t) (verl's sequence IS,
TRL's sequence modes: the product of the token ratios). Rejection statistics (verl's
``rollout_rs``): k1 = -lr (= log pi_rollout / pi_proximal), k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr,
per token, or summed / averaged / maxed over a sequence's valid tokens. k1 modes keep
log(rs_low) <= stat <= log(rs_high); k2 / k3 modes keep stat <= rs_threshold. All log-ratios
are clamped to +-20 first, as verl does.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_grpo.loss.ratios import clamp_log_ratio
from megatron_grpo.registry import Registry

CORRECTIONS = Registry("correction")

WEIGHT_ONLY = frozenset({"tis", "seq_tis"})
"""Corrections that never mask a token: no effect in ``bypass`` mode."""

Weights = Tuple[torch.Tensor, torch.Tensor]


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1, keepdim=True)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_sum(x, mask) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def _seq_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = torch.where(mask > 0, x, torch.full_like(x, float("-inf"))).amax(-1, keepdim=True)
    return torch.where(torch.isinf(out), torch.zeros_like(out), out)  # no valid token: 0, as verl


def _token_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(clamp_log_ratio(log_ratio))


def _sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.exp(clamp_log_ratio(_seq_sum(clamp_log_ratio(log_ratio), mask))).expand_as(log_ratio)


@CORRECTIONS.register("tis")
def truncated_importance_sampling(log_ratio, mask, cfg) -> Weights:
    """Token TIS (verl ``rollout_is=token``, NeMo-RL ``tis``): w = min(r_t, tis_cap)."""
    raw = _token_ratio(log_ratio)
    return raw.clamp(max=cfg.tis_cap), raw


@CORRECTIONS.register("seq_tis")
def sequence_truncated_importance_sampling(log_ratio, mask, cfg) -> Weights:
    """Sequence TIS (verl ``rollout_is=sequence``): w = min(s_i, tis_cap) for every token of i."""
    raw = _sequence_ratio(log_ratio, mask.float())
    return raw.clamp(max=cfg.tis_cap), raw


@CORRECTIONS.register("icepop")
def icepop(log_ratio, mask, cfg) -> Weights:
    """IcePop (Ring / Ling team; NeMo-RL ``icepop``): w = r_t inside [icepop_low, icepop_high], else 0."""
    raw = _token_ratio(log_ratio)
    keep = (raw >= cfg.icepop_low) & (raw <= cfg.icepop_high)
    return torch.where(keep, raw, torch.zeros_like(raw)), raw


@CORRECTIONS.register("mis")
def masked_importance_sampling(log_ratio, mask, cfg) -> Weights:
    """Token masked IS (TRL's ``token_mask``): w = r_t where r_t <= tis_cap, else 0."""
    raw = _token_ratio(log_ratio)
    return torch.where(raw <= cfg.tis_cap, raw, torch.zeros_like(raw)), raw


@CORRECTIONS.register("seq_mis")
def sequence_masked_importance_sampling(log_ratio, mask, cfg) -> Weights:
    """Sequence masked IS (TRL's ``sequence_mask``): w = s_i where s_i <= tis_cap, else 0."""
    raw = _sequence_ratio(log_ratio, mask.float())
    return torch.where(raw <= cfg.tis_cap, raw, torch.zeros_like(raw)), raw


@CORRECTIONS.register("seq_mask_tis")
def seq_mask_tis(log_ratio, mask, cfg) -> Weights:
    """NeMo-RL's seq-mask-tis: sequences whose geometric-mean ratio exp(mean_t lr_t) is outside
    [seq_mask_low, seq_mask_high] are dropped; kept tokens are weighted by r_t, untruncated."""
    raw = _token_ratio(log_ratio)
    geo = torch.exp(clamp_log_ratio(_seq_mean(log_ratio, mask.float())))
    keep = (geo >= cfg.seq_mask_low) & (geo <= cfg.seq_mask_high)
    return torch.where(keep, raw, torch.zeros_like(raw)), raw


def _divergence(kind: str, log_ratio: torch.Tensor) -> torch.Tensor:
    lr = clamp_log_ratio(log_ratio)
    if kind == "k1":
        return -lr
    if kind == "k2":
        return 0.5 * lr * lr
    return torch.exp(lr) - 1.0 - lr


def _rejection(level: str, kind: str):
    def reject(log_ratio, mask, cfg) -> Weights:
        maskf = mask.float()
        stat = _divergence(kind, log_ratio)
        if level != "token":
            stat = {"sum": _seq_sum, "mean": _seq_mean, "max": _seq_max}[level](stat, maskf).expand_as(log_ratio)
        if kind == "k1":
            keep = (stat >= torch.log(torch.tensor(cfg.rs_low))) & (stat <= torch.log(torch.tensor(cfg.rs_high)))
        else:
            keep = stat <= cfg.rs_threshold
        return keep.float(), torch.ones_like(log_ratio)

    scope = "token" if level == "token" else f"sequence {level}"
    rule = "in [log rs_low, log rs_high]" if kind == "k1" else "<= rs_threshold"
    reject.__doc__ = f"Rejection sampling (verl ``rollout_rs``): keep where the {scope} of {kind} is {rule}."
    return reject


for _level, _kinds in (("token", "k1 k2 k3"), ("sum", "k1 k2 k3"), ("mean", "k1 k2 k3"), ("max", "k2 k3")):
    for _kind in _kinds.split():
        CORRECTIONS.add(f"token_{_kind}" if _level == "token" else f"seq_{_level}_{_kind}", _rejection(_level, _kind))


def names_of(correction: str) -> list:
    """``"tis,seq_mean_k3"`` -> ``["tis", "seq_mean_k3"]``."""
    return [n.strip() for n in correction.split(",") if n.strip()]


def combined(correction: str, log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> Weights:
    """The product of the named corrections' weights and of their raw weights."""
    weight, raw = None, None
    for name in names_of(correction):
        w, r = CORRECTIONS.get(name)(log_ratio, mask, cfg)
        weight, raw = (w, r) if weight is None else (weight * w, raw * r)
    return weight, raw


def get_correction(name: str):
    """The correction function registered as ``name``."""
    return CORRECTIONS.get(name)
