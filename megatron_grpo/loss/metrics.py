"""The precision and clipping metrics of MECHANISM.md, as additive statistics.

``precision_stats`` (alpha/beta), ``clip_stats`` (region / zero-gradient, phantom /
legit / rescued) and ``deployed_improvement_stats`` fill a ``StatSet``; ``finalize``
turns the reduced sums into the contract's metric names. Definitions:

    alpha = shadow - old          (real policy change + lag, as the generator sees it)
    beta  = log_probs - shadow    (pure precision gap)
    phantom: clipped under the effective ratio but not under the clean ratio exp(alpha)
    legit:   clipped under the clean ratio and under the effective one
    rescued: clipped under the clean ratio but not under the effective one
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from megatron_grpo.loss.clips import outside_region
from megatron_grpo.loss.stats import StatSet, masked_max, masked_sum
from megatron_grpo.models.routing import same_experts

COMMON_LOGPROB = -5.0
"""Rollout log-prob above which a token is ``common``."""
RARE_LOGPROB = -20.0
"""Rollout log-prob at or below which a token is ``rare``; in between is ``medium``."""
SHADOW_STATS = ("kl_rollout",)
"""Statistics made from the trainer's own log-probs when the loss gets no shadow, though defined on the
shadow (``policy/kl_rollout``: current = the shadow forward): the step drops them where it samples the
shadow out (``grpo.diagnostics_every``), so that a metric's series never mixes two definitions."""


def precision_stats(stats: StatSet, log_probs, shadow, old, adv, mask) -> None:
    """alpha/beta sums, beta by token rarity, and the sums for corr(beta, A)."""
    beta = (log_probs.detach() - shadow).double()
    alpha = (shadow - old).double()
    adv = adv.double()
    stats.add_sum("beta", masked_sum(beta, mask))
    stats.add_sum("beta_abs", masked_sum(beta.abs(), mask))
    stats.add_sum("beta_sq", masked_sum(beta * beta, mask))
    stats.add_max("beta_abs_max", masked_max(beta.abs(), mask))
    stats.add_sum("alpha_abs", masked_sum(alpha.abs(), mask))
    stats.add_sum("adv", masked_sum(adv, mask))
    stats.add_sum("adv_sq", masked_sum(adv * adv, mask))
    stats.add_sum("adv_beta", masked_sum(adv * beta, mask))
    buckets = {
        "common": old > COMMON_LOGPROB,
        "medium": (old > RARE_LOGPROB) & (old <= COMMON_LOGPROB),
        "rare": old <= RARE_LOGPROB,
    }
    for name, in_bucket in buckets.items():
        sel = mask & in_bucket
        stats.add_sum(f"beta_abs_{name}", masked_sum(beta.abs(), sel))
        stats.add_sum(f"n_{name}", sel.sum())


def gap_in_ratio_stats(stats: StatSet, ratio_value, shadow, old, mask) -> None:
    """The gap the ratio's value carries beyond alpha (``ratio: gap_scaled``: k * beta), as |log r - alpha|."""
    in_ratio = (torch.log(ratio_value.double().clamp(min=1e-300)) - (shadow - old).double()).abs()
    stats.add_sum("gap_in_ratio_abs", masked_sum(in_ratio, mask))


def _gates(family, ratio_value, adv, mask, cfg):
    """(outside the region, gradient zeroed, weight truncated) per token, at the family's level."""
    value = family.gate_value(ratio_value, mask)
    return outside_region(value, cfg), family.zero_grad(value, adv, cfg), family.truncated(value, adv, cfg)


def clip_stats(stats: StatSet, family, ratio_value, clean_ratio, adv, mask, cfg) -> None:
    """Region, zero-gradient and truncation counts from the family's declared gate (at its level:
    a sequence-level family gates every token of a sequence together, and each counts); phantom /
    legit / rescued when ``clean_ratio`` (the ratio without beta) is known."""
    region, zero, trunc = _gates(family, ratio_value, adv, mask, cfg)
    stats.add_sum("clip_region", (region & mask).sum())
    stats.add_sum("clip_zero_grad", (zero & mask).sum())
    stats.add_sum("clip_truncated", (trunc & mask).sum())
    if clean_ratio is None:
        return
    clean_region, clean_zero, clean_trunc = _gates(family, clean_ratio, adv, mask, cfg)
    stats.add_sum("clip_phantom_region", (region & ~clean_region & mask).sum())
    stats.add_sum("clip_legit_region", (region & clean_region & mask).sum())
    stats.add_sum("clip_rescued_region", (~region & clean_region & mask).sum())
    stats.add_sum("clip_phantom_zero_grad", (zero & ~clean_zero & mask).sum())
    stats.add_sum("clip_legit_zero_grad", (zero & clean_zero & mask).sum())
    stats.add_sum("clip_phantom_truncated", (trunc & ~clean_trunc & mask).sum())
    stats.add_sum("clip_legit_truncated", (trunc & clean_trunc & mask).sum())


def correction_stats(stats: StatSet, weight, raw, mask) -> None:
    """What a rollout correction did: applied weight, masked tokens and sequences, truncated
    tokens, and the pre-truncation (raw) importance weights: mean, max, min."""
    masked = (weight == 0) & mask
    stats.add_sum("correction_weight", masked_sum(weight, mask))
    stats.add_sum("correction_masked", masked.sum())
    stats.add_sum("correction_seq_masked", masked.any(-1).sum())
    stats.add_sum("correction_truncated", ((weight > 0) & (weight < raw) & mask).sum())
    stats.add_sum("correction_raw", masked_sum(raw, mask))
    stats.add_max("correction_raw_max", masked_max(raw, mask))
    stats.add_max("correction_raw_neg_max", masked_max(-raw, mask, default=0.0))


def compat_stats(stats: StatSet, train_lp, rollout_lp, mask, is_weight=None) -> None:
    """Peers' trainer-vs-generator mismatch metrics from the same tensors (train = the trainer's
    own log-probs, as NeMo-RL's prev_logprobs and verl's old_log_prob). ``is_weight``: the
    correction's applied weight (NeMo-RL's sampling_importance_ratio is after truncation)."""
    maskf = mask.double()
    lr = (train_lp.detach() - rollout_lp).double().clamp(-20.0, 20.0)
    ratio = torch.exp(lr)
    stats.add_sum("compat_mult_prob_error", masked_sum(torch.exp(lr.abs()), mask))
    stats.add_sum("compat_gen_kl", masked_sum(ratio - 1.0 - lr, mask))
    stats.add_sum("compat_is_ratio", masked_sum(ratio if is_weight is None else is_weight, mask))
    stats.add_sum("compat_k1", masked_sum(-lr, mask))
    stats.add_sum("compat_chi2_token", masked_sum(ratio * ratio, mask))
    stats.add_sum("n_seqs", mask.any(-1).sum())
    # verl's per-sequence metrics (compute_offpolicy_metrics): means over every row, an empty one
    # adding |0| (log_ppl_abs_diff) and e^0 (chi2_seq); token log-ratios unclamped, the sum clamped
    seq_lr = torch.where(mask, (train_lp.detach() - rollout_lp).double(), 0.0).sum(-1)
    stats.add_sum("n_rows", torch.ones_like(seq_lr).sum())
    stats.add_sum("compat_chi2_seq", torch.exp(2.0 * seq_lr.clamp(-20.0, 20.0)).sum())
    stats.add_sum("compat_log_ppl_abs_diff", (seq_lr / maskf.sum(-1).clamp(min=1.0)).abs().sum())


def route_disagreements(train_routes, natural_routes, ref_routes) -> torch.Tensor:
    """``[2 * B * S + 1]``: per token, in how many of this model's (pipeline stage's) MoE layers the routing
    the trainer's forward used differs from the reference (shadow / generator) routing (first ``B * S``)
    and from its own natural choice (next ``B * S``: the replay overrode it), then the number of layers.
    Every entry sums over layers, so pipeline stages add theirs up. Routes are ``[B, S, L, k]``."""
    differ = ~same_experts(train_routes, ref_routes)
    replayed = ~same_experts(train_routes, natural_routes)
    num_layers = torch.tensor([train_routes.shape[2]], device=train_routes.device)
    return torch.cat([differ.sum(-1).flatten(), replayed.sum(-1).flatten(), num_layers])


def routing_stats(stats: StatSet, train_routes, natural_routes, ref_routes, beta, mask,
                  sum_stages: Callable[[torch.Tensor], torch.Tensor] = lambda counts: counts) -> None:
    """MoE routing agreement per (token, layer) between the routing the trainer's forward used and the
    reference (shadow/generator) routing, the share the replay overrode, and |beta| split by whether a
    token's routing matched in every layer. Routes are ``[B, S, L, k]`` of this model's MoE layers;
    ``sum_stages`` adds up ``route_disagreements`` over the pipeline stages (each holding its layers)."""
    counts = sum_stages(route_disagreements(train_routes, natural_routes, ref_routes))
    differ, replayed = counts[:-1].view(2, *mask.shape).unbind(0)
    num_layers, any_differ = counts[-1], differ > 0
    beta_abs = beta.detach().double().abs()
    stats.add_sum("route_decisions", mask.sum() * num_layers)
    stats.add_sum("route_mismatch", masked_sum(differ, mask))
    stats.add_sum("route_replayed", masked_sum(replayed, mask))
    stats.add_sum("route_tokens_mismatch", (any_differ & mask).sum())
    stats.add_sum("beta_abs_route_mismatch", masked_sum(beta_abs, mask & any_differ))
    stats.add_sum("beta_abs_route_match", masked_sum(beta_abs, mask & ~any_differ))


def k3(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) per token, for tokens sampled from p:
    exp(q - p) - (q - p) - 1 (>= 0; unbiased only under samples from p)."""
    diff = (log_q - log_p).clamp(-20.0, 20.0)
    return torch.exp(diff) - diff - 1.0


KL_PENALTY_MAX = 10.0
"""The per-token k3 of the reference KL penalty is clamped to <= 10, as verl's ``low_var_kl`` / ``k3`` and NeMo-RL's
``kl_output_clamp_value`` (default 10) do: a token far from the reference (ref - cur > ~2.5 nats) adds 10 and no
gradient, instead of up to e^20."""


def kl_ref_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """The reference KL penalty per token (``loss_fn.reference_policy_kl_penalty``, ``policy/kl_ref``): k3 of
    KL(current || reference), exp(ref - cur) - (ref - cur) - 1, log-ratio clamped to +-20 and k3 to
    <= ``KL_PENALTY_MAX`` (verl's ``low_var_kl``; NeMo-RL's k3 value)."""
    return k3(log_probs, ref_log_probs).clamp(max=KL_PENALTY_MAX)


def kl_rollout_k3(current: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """KL(rollout || current) per token with r = pi_current / pi_rollout: (r - 1) - log r.

    The tokens were sampled from the rollout policy, so this is the orientation whose
    expectation is a KL (verl's ``rollout_corr/k3_kl``); exp(rollout - current) - ... - 1
    would estimate KL(current || rollout) only under samples from the current policy."""
    return k3(rollout, current)


def deployed_improvement_stats(lp_before, lp_after, advantages, mask) -> StatSet:
    """Stats for ``policy/deployed_improvement``: mean of (after - before) * sign(A) over valid tokens."""
    adv = advantages.unsqueeze(-1).expand_as(lp_before) if advantages.dim() == 1 else advantages
    stats = StatSet()
    stats.add_sum("n_tokens", mask.sum())
    stats.add_sum("deployed", masked_sum((lp_after - lp_before).double() * torch.sign(adv).double(), mask))
    return stats


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num))


def _nan_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den``, NaN (null in metrics.jsonl) where ``den`` is 0: a ratio that is undefined, not 0."""
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(num, float("nan")))


def finalize(sums: Dict[str, torch.Tensor], maxes: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Reduced sums/maxima -> contract metric names (0-dim fp32 tensors, no host sync)."""
    n = sums["n_tokens"]
    out: Dict[str, torch.Tensor] = {}
    if "loss" in sums:
        out["loss/policy"] = sums["loss"]
    simple = {
        "policy/kl_rollout": "kl_rollout", "policy/kl_ref": "kl_ref",
        "clip/region_fraction": "clip_region", "clip/zero_grad_fraction": "clip_zero_grad",
        "clip/phantom_region_fraction": "clip_phantom_region", "clip/legit_region_fraction": "clip_legit_region",
        "clip/rescued_region_fraction": "clip_rescued_region",
        "clip/phantom_zero_grad_fraction": "clip_phantom_zero_grad",
        "clip/legit_zero_grad_fraction": "clip_legit_zero_grad", "clip/truncated_fraction": "clip_truncated",
        "clip/phantom_truncated_fraction": "clip_phantom_truncated",
        "clip/legit_truncated_fraction": "clip_legit_truncated",
        "correction/weight_mean": "correction_weight", "correction/masked_fraction": "correction_masked",
        "policy/deployed_improvement": "deployed",
    }
    for metric, key in simple.items():
        if key in sums:
            out[metric] = _safe_div(sums[key], n)
    if "correction_raw" in sums:
        out.update(_correction_metrics(sums, maxes, n))
    if "compat_gen_kl" in sums:
        out.update(_compat_metrics(sums, n))
    if "beta" in sums:
        out.update(_precision_metrics(sums, maxes, n))
    if "route_decisions" in sums:
        out.update(_routing_metrics(sums, n))
    return {k: v.float() for k, v in out.items()}


def _precision_metrics(sums, maxes, n) -> Dict[str, torch.Tensor]:
    beta_mean = _safe_div(sums["beta"], n)
    beta_abs_mean = _safe_div(sums["beta_abs"], n)
    beta_var = (_safe_div(sums["beta_sq"], n) - beta_mean**2).clamp(min=0.0)
    adv_mean = _safe_div(sums["adv"], n)
    adv_var = (_safe_div(sums["adv_sq"], n) - adv_mean**2).clamp(min=0.0)
    cov = _safe_div(sums["adv_beta"], n) - adv_mean * beta_mean
    alpha_abs_mean = _safe_div(sums["alpha_abs"], n)
    out = {
        "precision/beta_mean": beta_mean,
        "precision/beta_abs_mean": beta_abs_mean,
        "precision/beta_std": beta_var.sqrt(),
        "precision/beta_abs_max": maxes["beta_abs_max"],
        "precision/beta_adv_corr": _safe_div(cov, (beta_var * adv_var).sqrt()),
        "precision/alpha_abs_mean": alpha_abs_mean,
        # NaN (written as null) when beta is exactly 0, e.g. the shadow forward is skipped
        "precision/snr": _nan_div(alpha_abs_mean, beta_abs_mean),
    }
    for name in ("common", "medium", "rare"):  # NaN (null) for a bucket without tokens: not a gap of 0
        out[f"precision/beta_abs_mean_{name}"] = _nan_div(sums[f"beta_abs_{name}"], sums[f"n_{name}"])
    if "gap_in_ratio_abs" in sums:  # ratio: gap_scaled (the research knob): the gap the clip sees, k * beta
        gap = _safe_div(sums["gap_in_ratio_abs"], n)
        out["precision/gap_in_ratio_abs_mean"] = gap
        out["precision/snr_in_ratio"] = _nan_div(alpha_abs_mean, gap)
    return out


def _correction_metrics(sums, maxes, n) -> Dict[str, torch.Tensor]:
    return {
        "correction/seq_masked_fraction": _safe_div(sums["correction_seq_masked"], sums["n_seqs"]),
        "correction/truncated_fraction": _safe_div(sums["correction_truncated"], n),
        "correction/raw_weight_mean": _safe_div(sums["correction_raw"], n),
        "correction/raw_weight_max": maxes["correction_raw_max"],
        "correction/raw_weight_min": -maxes["correction_raw_neg_max"],
    }


def _compat_metrics(sums, n) -> Dict[str, torch.Tensor]:
    """NeMo-RL's and verl's names (docs/guides/losses-and-metrics.md)."""
    rows = sums["n_rows"]  # verl: every row, empty ones included
    return {
        "compat/token_mult_prob_error": _safe_div(sums["compat_mult_prob_error"], n),
        "compat/gen_kl_error": _safe_div(sums["compat_gen_kl"], n),
        "compat/sampling_importance_ratio": _safe_div(sums["compat_is_ratio"], n),
        "compat/rollout_corr/kl": _safe_div(sums["compat_k1"], n),
        "compat/rollout_corr/k3_kl": _safe_div(sums["compat_gen_kl"], n),
        "compat/rollout_corr/chi2_token": _safe_div(sums["compat_chi2_token"], n) - 1.0,
        "compat/rollout_corr/chi2_seq": _safe_div(sums["compat_chi2_seq"], rows) - 1.0,
        "compat/rollout_corr/log_ppl_abs_diff": _safe_div(sums["compat_log_ppl_abs_diff"], rows),
    }


def _routing_metrics(sums, n) -> Dict[str, torch.Tensor]:
    decisions, mismatched_tokens = sums["route_decisions"], sums["route_tokens_mismatch"]
    return {
        "moe/route_mismatch_fraction": _safe_div(sums["route_mismatch"], decisions),
        "moe/route_replayed_fraction": _safe_div(sums["route_replayed"], decisions),
        "moe/tokens_any_mismatch": _safe_div(mismatched_tokens, n),
        "precision/beta_abs_mean_route_match": _safe_div(sums["beta_abs_route_match"], n - mismatched_tokens),
        "precision/beta_abs_mean_route_mismatch": _safe_div(sums["beta_abs_route_mismatch"], mismatched_tokens),
    }
