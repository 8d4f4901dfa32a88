"""The GRPO policy loss: ratio source x clip variant x correction x aggregation.

Rank-agnostic math. Global token/sequence counts come in as arguments (NeMo-RL's
contract), so per-micro-batch losses summed over micro-batches and data-parallel
ranks equal the loss of the whole global batch; the only collectives (through
``megatron_grpo.parallel.comm``) are the count reduction when counts are not given,
the ``detach_center`` mean when it is not given, and the one metric reduction in
``policy_loss``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_grpo.loss import aggregation, clips, corrections, metrics, ratios
from megatron_grpo.loss.config import LossConfig
from megatron_grpo.loss.stats import StatSet, masked_sum
from megatron_grpo.parallel import comm


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    shadow_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    num_global_tokens=None,
    num_global_seqs=None,
    weight_center=None,
    dp_group=None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GRPO loss of one (micro-)batch and its metrics reduced over ``dp_group``.

    Args:
        log_probs: ``[B, T]`` fp32 trainer log-probs of the sampled tokens (with grad).
        old_log_probs: ``[B, T]`` generator log-probs reported at sampling time.
        advantages: ``[B]`` per sequence or ``[B, T]`` per token (any float dtype; cast to fp32 here).
        mask: ``[B, T]`` bool, True at valid completion tokens.
        config: the loss configuration.
        shadow_log_probs: ``[B, T]`` low-precision shadow log-probs at the current weights.
        ref_log_probs: ``[B, T]`` reference-policy log-probs (for the KL penalty).
        num_global_tokens: valid tokens in the global batch (all micro-batches, all DP ranks);
            None = this call's tokens summed over ``dp_group`` (the call is the whole batch).
        num_global_seqs: sequences with a valid token in the global batch (seq aggregations).
        weight_center: ``detach_center`` only: mu_W over the global batch (``weight_center``
            below); None = this call's mean over ``dp_group`` (the call is the whole batch).
        dp_group: data-parallel group for counts and metrics; None = single process.

    Returns:
        ``(loss, metrics)``: a 0-dim loss and a dict of 0-dim fp32 tensors named as in MECHANISM.md.
    """
    loss, stats = policy_loss_stats(
        log_probs, old_log_probs, advantages, mask, config, shadow_log_probs=shadow_log_probs,
        ref_log_probs=ref_log_probs, num_global_tokens=num_global_tokens,
        num_global_seqs=num_global_seqs, weight_center=weight_center, dp_group=dp_group,
    )
    return loss, metrics.finalize(*stats.reduce(dp_group))


def policy_loss_stats(
    log_probs, old_log_probs, advantages, mask, config: LossConfig, *, shadow_log_probs=None,
    ref_log_probs=None, num_global_tokens=None, num_global_seqs=None, weight_center=None, dp_group=None,
) -> Tuple[torch.Tensor, StatSet]:
    """As ``policy_loss`` but returns unreduced statistics, to merge across micro-batches.

    A call with given global counts may hold no valid token (a micro-batch of a larger batch):
    its loss is 0 with the graph intact, so every rank runs the same collectives."""
    adv = validate_inputs(log_probs, old_log_probs, advantages, mask, config, shadow_log_probs, ref_log_probs,
                          allow_empty=num_global_tokens is not None)
    num_global_tokens, num_global_seqs = _global_counts(mask, num_global_tokens, num_global_seqs, dp_group)
    ratio, proximal = importance_ratio(log_probs, old_log_probs, shadow_log_probs, config)
    clip = clips.get_clip_variant(config.clip)
    if getattr(clip, "needs_center", False) and weight_center is None:
        weight_center = _global_token_mean(clips.ppo_weight(ratio.detach(), adv, config), mask, dp_group)
    per_token = clip.loss(ratio, adv, log_probs, config, weight_center, mask)
    stats = StatSet()
    stats.add_sum("n_tokens", mask.sum())
    weights = None
    if config.correction is not None:
        weights, raw = correction_weights(proximal, old_log_probs, mask, config)
        per_token = per_token * weights
        metrics.correction_stats(stats, weights, raw, mask)
    metrics.compat_stats(stats, log_probs, old_log_probs, mask, weights)
    if ref_log_probs is not None:
        kl_ref = metrics.kl_ref_k3(log_probs, ref_log_probs)
        stats.add_sum("kl_ref", masked_sum(kl_ref.detach(), mask))
        if config.reference_policy_kl_penalty > 0:
            per_token = per_token + config.reference_policy_kl_penalty * kl_ref
    agg = aggregation.AGGREGATIONS.get(config.aggregation)
    loss = agg(per_token, mask, num_global_tokens, num_global_seqs).to(log_probs.dtype)
    stats.add_sum("loss", loss)
    clean = None if shadow_log_probs is None else _clean_ratio(shadow_log_probs, old_log_probs, config)
    _add_diagnostics(stats, clip, ratio.detach(), clean, log_probs, old_log_probs, shadow_log_probs, adv, mask, config)
    return loss, stats


def decoupled(config: LossConfig) -> bool:
    """True when the PPO ratio is taken against the proximal (trainer's own) log-probs: a
    correction is set and ``correction_mode == "decoupled"`` (NeMo-RL / verl's decoupled PPO)."""
    return config.correction is not None and config.correction_mode == "decoupled"


def importance_ratio(log_probs, old_log_probs, shadow_log_probs, config: LossConfig):
    """``(ratio [B, T], proximal [B, T])``: the ratio the clip sees, and the proximal log-probs,
    the trainer's own detached view at the current weights (the shadow forward for
    ``ratio=shadow``, the trainer's log-probs otherwise) that corrections compare with the
    generator's.

    Without a correction, or in ``bypass`` mode, the ratio is taken against the generator's
    log-probs. In ``decoupled`` mode it is taken against the proximal log-probs, so its value
    is 1 within a step and the trainer-vs-generator gap goes to the correction's weight."""
    use_shadow = config.ratio == "shadow" and shadow_log_probs is not None
    proximal = (shadow_log_probs if use_shadow else log_probs).detach()
    base = proximal if decoupled(config) else old_log_probs
    source = ratios.get_ratio_source(config.ratio)
    if getattr(source, "takes_gap_scale", False):
        scale = ratios.gap_scale_of(old_log_probs, config.gap_scale, config.gap_scale_by_logprob)
        return source(log_probs, base, shadow_log_probs, scale), proximal
    return source(log_probs, base, shadow_log_probs), proximal


def correction_weights(proximal, old_log_probs, mask, config: LossConfig):
    """``(weights, raw)`` per token, no gradient: decoupled = the corrections' IS weight of proximal
    vs generator (truncated / masked); bypass = only their mask (the PPO ratio against the
    generator already carries the IS weight: multiplying again would count it twice). ``raw`` is
    the importance weight before truncation or masking."""
    weights, raw = corrections.combined(config.correction, proximal.detach() - old_log_probs, mask, config)
    if config.correction_mode == "bypass":
        weights = (weights > 0).to(weights.dtype)
    return weights.detach(), raw.detach()


def _clean_ratio(shadow, old, config: LossConfig) -> torch.Tensor:
    """The ratio the loss would use without beta (the clean ratio of MECHANISM.md)."""
    if decoupled(config):  # against the proximal policy: the same forward, so no beta within a step
        return torch.ones_like(shadow)
    return torch.exp(ratios.clamp_log_ratio(shadow - old))


def weight_center(log_probs, old_log_probs, advantages, mask, config: LossConfig, *, shadow_log_probs=None,
                  dp_group=None) -> torch.Tensor:
    """mu_W of ``detach_center``: the mean of W = min(rA, clamp(r)A) over the valid tokens of
    every row given here and on every rank of ``dp_group``. The step calls it once, before the
    schedule, on no-grad log-probs of all its rows, so that every micro-batch centres on the
    mean of the whole global batch (the write-up's mu_W)."""
    adv = validate_inputs(log_probs, old_log_probs, advantages, mask, config, shadow_log_probs, None,
                          allow_empty=True)
    ratio, _ = importance_ratio(log_probs.detach(), old_log_probs, shadow_log_probs, config)
    return _global_token_mean(clips.ppo_weight(ratio.detach(), adv, config), mask, dp_group)


def _add_diagnostics(stats, clip, ratio_value, clean, log_probs, old, shadow, adv, mask, config) -> None:
    current = shadow if shadow is not None else log_probs.detach()
    stats.add_sum("kl_rollout", masked_sum(metrics.kl_rollout_k3(current, old), mask))
    if shadow is not None:
        metrics.precision_stats(stats, log_probs, shadow, old, adv, mask)
        if config.ratio == "gap_scaled":
            metrics.gap_in_ratio_stats(stats, ratio_value, shadow, old, mask)
    metrics.clip_stats(stats, clip, ratio_value, clean, adv, mask, config)


def _global_counts(mask, num_global_tokens, num_global_seqs, dp_group):
    """Fills missing global counts by summing this call's counts over ``dp_group``."""
    if num_global_tokens is None:
        num_global_tokens = comm.all_reduce_sum(mask.sum().double(), dp_group)
    if num_global_seqs is None:
        num_global_seqs = comm.all_reduce_sum(mask.any(-1).sum().double(), dp_group)
    return num_global_tokens, num_global_seqs


def _global_token_mean(x: torch.Tensor, mask: torch.Tensor, dp_group) -> torch.Tensor:
    """Mean of ``x`` over the valid tokens of this call on every rank of ``dp_group`` (float64)."""
    packed = torch.stack([masked_sum(x, mask), mask.sum().double()])
    packed = comm.all_reduce_sum(packed, dp_group)
    return packed[0] / packed[1].clamp(min=1.0)


def validate_inputs(log_probs, old_log_probs, advantages, mask, config, shadow, ref,
                    allow_empty: bool = False) -> torch.Tensor:
    """Checks shapes, dtypes and finiteness; returns fp32 advantages broadcast to ``[B, T]``.
    An empty mask is an error unless ``allow_empty`` (a micro-batch of a larger batch)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    if log_probs.dim() != 2 or log_probs.shape != mask.shape:
        raise ValueError(f"log_probs shape {tuple(log_probs.shape)} must be [B, T] and equal mask shape {tuple(mask.shape)}")
    for name, t in (("old_log_probs", old_log_probs), ("shadow_log_probs", shadow), ("ref_log_probs", ref)):
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match mask shape {tuple(mask.shape)}")
    if advantages.shape == mask.shape[:1]:
        adv = advantages.unsqueeze(-1).expand_as(log_probs)
    elif advantages.shape == mask.shape:
        adv = advantages
    else:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be [B]={mask.shape[0]} or [B, T]={tuple(mask.shape)}")
    if config.reference_policy_kl_penalty > 0 and ref is None:
        raise ValueError("loss_fn.reference_policy_kl_penalty > 0 needs ref_log_probs")
    if config.check_finite:
        _check_finite(mask, allow_empty, log_probs=log_probs, old_log_probs=old_log_probs, advantages=adv,
                      shadow_log_probs=shadow, ref_log_probs=ref)
    elif not allow_empty and not bool(mask.any()):
        raise ValueError("mask has no valid tokens (empty mask)")
    return adv.float()


def _check_finite(mask, allow_empty: bool, **tensors) -> None:
    """One host sync: counts valid tokens and non-finite values at valid tokens per input."""
    names = [n for n, t in tensors.items() if t is not None]
    counts = [mask.sum()] + [(~torch.isfinite(tensors[n].detach()) & mask).sum() for n in names]
    counts = torch.stack(counts).tolist()
    if counts[0] == 0 and not allow_empty:
        raise ValueError("mask has no valid tokens (empty mask)")
    for name, bad in zip(names, counts[1:]):
        if bad:
            raise ValueError(f"{name} has {bad} non-finite (NaN/inf) values at valid tokens")
