"""Configuration of the GRPO policy loss (the recipe's ``loss_fn`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class LossConfig:
    """The GRPO/PPO policy loss: ratio source, clip variant, aggregation, corrections."""

    ratio: str = "train"
    """Where the importance ratio's value comes from: ``train`` (trainer log-probs vs
    rollout, what PPO normally sees), ``shadow`` (low-precision shadow forward vs rollout:
    the precision gap beta removed, gradient still through the trainer's log-probs) or
    ``one`` (REINFORCE: value 1). Any name registered in ``megatron_grpo.loss.ratios``."""

    clip: str = "ppo"
    """Surrogate: ``ppo`` (-min(rA, clip(r)A)), ``none`` (-rA), ``detach`` (-W.detach()*logp
    with W = min(rA, clip(r)A)) or ``detach_center`` (W minus its token mean)."""

    ratio_clip_min: float = 0.2
    """eps_low: the ratio is clipped below at max(0, 1 - ratio_clip_min); >= 1 leaves it
    unclipped below (the write-up's no-clip run: eps = 10)."""

    ratio_clip_max: float = 0.2
    """eps_high: the ratio is clipped above at 1 + ratio_clip_max (DAPO's clip-higher if larger)."""

    aggregation: str = "token_mean"
    """How per-token losses become one number: ``token_mean`` (over all valid tokens of
    the global batch), ``seq_mean_token_mean`` or ``seq_mean_token_sum``."""

    correction: Optional[str] = None
    """Off-policy correction from r = pi_proximal / pi_generator, computed without gradient:
    None, ``tis`` (truncated importance sampling, weight min(r, tis_cap)), ``icepop`` (weight r
    for tokens with r in [icepop_low, icepop_high], 0 outside), ``token_k1`` (the same band as
    a pure 0/1 mask) or ``seq_mask_tis`` (drop whole sequences whose geometric-mean ratio is
    outside [seq_mask_low, seq_mask_high], TIS-weight the tokens of the others)."""

    correction_mode: str = "decoupled"
    """How a correction combines with the PPO ratio (ignored without a correction, where the
    ratio is against the generator: standard PPO, the write-up's runs). ``decoupled`` (NeMo-RL,
    verl's default): the PPO ratio is against the proximal policy (the trainer's own detached
    log-probs at the current weights) and the correction's weight carries proximal vs
    generator. ``bypass`` (verl's bypass_mode): the PPO ratio is against the generator and the
    correction contributes only its mask (no second importance weight)."""

    tis_cap: float = 2.0
    """C in TIS's min(r, C) (``tis`` and ``seq_mask_tis``)."""

    icepop_low: float = 0.5
    """IcePop keeps tokens with ratio >= icepop_low."""

    icepop_high: float = 2.0
    """IcePop keeps tokens with ratio <= icepop_high."""

    seq_mask_low: float = 0.999
    """``seq_mask_tis`` keeps sequences whose geometric-mean ratio is >= seq_mask_low."""

    seq_mask_high: float = 1.001
    """``seq_mask_tis`` keeps sequences whose geometric-mean ratio is <= seq_mask_high."""

    reference_policy_kl_penalty: float = 0.0
    """Coefficient of the k3 KL(current || reference) penalty; needs reference log-probs
    when > 0 (NeMo-RL's key name)."""

    check_finite: bool = True
    """Raise ``ValueError`` when log-probs at valid tokens are NaN/inf (costs one host sync)."""

    def __post_init__(self):
        from megatron_grpo.loss import aggregation, clips, corrections, ratios

        if self.ratio not in ratios.RATIO_SOURCES:
            _bad("ratio", self.ratio, ratios.RATIO_SOURCES.names())
        if self.clip not in clips.CLIP_VARIANTS:
            _bad("clip", self.clip, clips.CLIP_VARIANTS.names())
        if self.aggregation not in aggregation.AGGREGATIONS:
            _bad("aggregation", self.aggregation, aggregation.AGGREGATIONS.names())
        if self.correction is not None and self.correction not in corrections.CORRECTIONS:
            _bad("correction", self.correction, ["null"] + corrections.CORRECTIONS.names())
        for key in ("ratio_clip_min", "ratio_clip_max", "tis_cap", "reference_policy_kl_penalty"):
            if getattr(self, key) < 0:
                raise ValueError(f"loss_fn.{key} must be >= 0, got {getattr(self, key)}")
        if self.correction_mode not in ("decoupled", "bypass"):
            raise ValueError(f"loss_fn.correction_mode must be decoupled or bypass, got {self.correction_mode!r}")
        if self.correction_mode == "bypass" and self.correction in corrections.WEIGHT_ONLY:
            raise ValueError(f"loss_fn.correction={self.correction} with loss_fn.correction_mode=bypass has no effect: "
                             f"the PPO ratio against the generator already carries the importance weight and "
                             f"{self.correction} masks nothing; use loss_fn.correction_mode=decoupled")
        if not 0 <= self.icepop_low <= self.icepop_high:
            raise ValueError(f"loss_fn.icepop_low/icepop_high must satisfy 0 <= low <= high, got {self.icepop_low}, {self.icepop_high}")
        if not 0 <= self.seq_mask_low <= self.seq_mask_high:
            raise ValueError(f"loss_fn.seq_mask_low/seq_mask_high must satisfy 0 <= low <= high, got {self.seq_mask_low}, {self.seq_mask_high}")


def _bad(key: str, value, valid) -> None:
    raise ValueError(f"loss_fn.{key}: unknown value {value!r}; valid choices: {', '.join(valid)}")
