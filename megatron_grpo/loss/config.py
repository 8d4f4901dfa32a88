"""Configuration of the GRPO policy loss (the recipe's ``loss_fn`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_grpo.loss import aggregation, clips, corrections, ratios


@dataclass
class LossConfig:
    """The GRPO/PPO policy loss: ratio source, clip variant, aggregation, corrections."""

    ratio: str = "train"
    """Where the importance ratio's value comes from: ``train`` (trainer log-probs vs
    rollout, what PPO normally sees), ``shadow`` (low-precision shadow forward vs rollout:
    the precision gap beta removed, gradient still through the trainer's log-probs),
    ``one`` (REINFORCE: value 1) or ``gap_scaled`` (research knob: alpha + gap_scale * beta).
    Any name registered in ``megatron_grpo.loss.ratios``."""

    gap_scale: float = 1.0
    """Research knob, not a fix (``ratio: gap_scaled`` only): k in the ratio's log value alpha + k * beta
    (alpha = shadow - generator, beta = trainer - shadow); the gradient is unchanged. k = 1 is ``train``,
    k = 0 is ``shadow``: a small model, whose gap is small, run at a larger model's gap (issue 34 item 5)."""

    gap_scale_by_logprob: Optional[List[List[float]]] = None
    """Rarity-shaped k_t (``ratio: gap_scaled``): ``[[lp_max, k], ...]`` with ascending lp_max; a token whose
    generator log-prob is <= lp_max takes the first such k, tokens above every lp_max take ``gap_scale``.
    null = ``gap_scale`` for every token."""

    clip: str = "ppo"
    """Policy-loss family: ``ppo`` (-min(rA, clip(r)A); dual clip with ``ratio_clip_c``), ``none``
    (-rA), ``detach`` (-W.detach()*logp with W = min(rA, clip(r)A)), ``detach_center`` (W minus
    its global token mean), ``gspo`` (sequence ratio exp(mean_t log r), clipped per sequence),
    ``cispo`` (-sg(clip(r)) * A * logp) or ``sapo`` (soft sigmoid gate). Any name registered in
    ``megatron_grpo.loss.clips``."""

    ratio_clip_min: float = 0.2
    """eps_low: the ratio is clipped below at max(0, 1 - ratio_clip_min); >= 1 leaves it
    unclipped below (the write-up's no-clip run: eps = 10)."""

    ratio_clip_max: float = 0.2
    """eps_high: the ratio is clipped above at 1 + ratio_clip_max (DAPO's clip-higher if larger)."""

    ratio_clip_c: Optional[float] = None
    """Dual clip (``ppo`` only; verl's clip_ratio_c, NeMo-RL's ratio_clip_c): the loss of A < 0
    tokens is bounded by -A * c, so a huge ratio cannot blow it up; null = off; must be > 1."""

    sapo_tau_pos: float = 1.0
    """``sapo``: gate temperature for A > 0 tokens (verl's tau_pos)."""

    sapo_tau_neg: float = 1.05
    """``sapo``: gate temperature for A <= 0 tokens (verl's tau_neg)."""

    aggregation: str = "token_mean"
    """How per-token losses become one number: ``token_mean`` (over all valid tokens of
    the global batch), ``seq_mean_token_mean`` or ``seq_mean_token_sum``."""

    correction: Optional[str] = None
    """Rollout correction from r = pi_proximal / pi_generator, without gradient; several names,
    comma-separated, multiply. Importance weights: ``tis`` (min(r_t, tis_cap)), ``seq_tis``
    (min(s_i, tis_cap), s_i = prod_t r_t), ``mis`` / ``seq_mis`` (r_t / s_i, 0 above tis_cap),
    ``icepop`` (r_t inside [icepop_low, icepop_high], 0 outside), ``seq_mask_tis`` (NeMo-RL: r_t,
    whole sequences dropped whose geometric-mean ratio is outside [seq_mask_low, seq_mask_high]).
    Rejection (verl's rollout_rs, a 0/1 mask): ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``,
    ``seq_mean_k{1,2,3}``, ``seq_max_k{2,3}``. null = none."""

    correction_mode: str = "decoupled"
    """How a correction combines with the PPO ratio (ignored without a correction, where the
    ratio is against the generator: standard PPO, the write-up's runs). ``decoupled`` (NeMo-RL,
    verl's default): the PPO ratio is against the proximal policy (the trainer's own detached
    log-probs at the current weights) and the correction's weight carries proximal vs
    generator. ``bypass`` (verl's bypass_mode): the PPO ratio is against the generator and the
    correction contributes only its mask (no second importance weight)."""

    tis_cap: float = 2.0
    """C in TIS's min(r, C) (``tis``, ``seq_tis``) and the cap above which ``mis`` / ``seq_mis`` drop a weight
    (``seq_mask_tis`` does not use it: its band is ``seq_mask_low`` / ``seq_mask_high``)."""

    icepop_low: float = 0.5
    """IcePop keeps tokens with ratio >= icepop_low."""

    icepop_high: float = 2.0
    """IcePop keeps tokens with ratio <= icepop_high."""

    seq_mask_low: float = 0.999
    """``seq_mask_tis`` keeps sequences whose geometric-mean ratio is >= seq_mask_low."""

    seq_mask_high: float = 1.001
    """``seq_mask_tis`` keeps sequences whose geometric-mean ratio is <= seq_mask_high."""

    rs_low: float = 0.5
    """k1 rejection keeps k1 = log(pi_rollout / pi_proximal) >= log(rs_low) (verl's lower bound)."""

    rs_high: float = 2.0
    """k1 rejection keeps k1 <= log(rs_high) (verl's upper bound)."""

    rs_threshold: float = 0.01
    """k2 / k3 rejection keeps statistics <= rs_threshold (verl's K3-RS preset: 0.01)."""

    reference_policy_kl_penalty: float = 0.0
    """Coefficient of the k3 KL(current || reference) penalty, min(exp(ref - cur) - (ref - cur) - 1, 10) per
    token (verl's ``low_var_kl``; NeMo-RL's key name and k3 value); needs reference log-probs when > 0."""

    check_finite: bool = True
    """Raise ``ValueError`` when log-probs at valid tokens are NaN/inf (costs one host sync)."""

    def __post_init__(self):
        if self.ratio not in ratios.RATIO_SOURCES:
            _bad("ratio", self.ratio, ratios.RATIO_SOURCES.names())
        if self.clip not in clips.CLIP_VARIANTS:
            _bad("clip", self.clip, clips.CLIP_VARIANTS.names())
        if self.aggregation not in aggregation.AGGREGATIONS:
            _bad("aggregation", self.aggregation, aggregation.AGGREGATIONS.names())
        self._check_correction()
        self._check_gap_scale()
        for key in ("ratio_clip_min", "ratio_clip_max", "tis_cap", "reference_policy_kl_penalty"):
            if getattr(self, key) < 0:
                raise ValueError(f"loss_fn.{key} must be >= 0, got {getattr(self, key)}")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"loss_fn.ratio_clip_c (dual clip) must be > 1 or null, got {self.ratio_clip_c}")
        if self.sapo_tau_pos <= 0 or self.sapo_tau_neg <= 0:
            raise ValueError("loss_fn.sapo_tau_pos and loss_fn.sapo_tau_neg must be > 0")
        if not 0 < self.rs_low <= self.rs_high or self.rs_threshold < 0:
            raise ValueError(f"loss_fn.rs_low/rs_high/rs_threshold must satisfy 0 < rs_low <= rs_high and "
                             f"rs_threshold >= 0, got {self.rs_low}, {self.rs_high}, {self.rs_threshold}")
        if not 0 <= self.icepop_low <= self.icepop_high:
            raise ValueError(f"loss_fn.icepop_low/icepop_high must satisfy 0 <= low <= high, got {self.icepop_low}, {self.icepop_high}")
        if not 0 <= self.seq_mask_low <= self.seq_mask_high:
            raise ValueError(f"loss_fn.seq_mask_low/seq_mask_high must satisfy 0 <= low <= high, got {self.seq_mask_low}, {self.seq_mask_high}")


    def _check_gap_scale(self) -> None:
        if self.ratio != "gap_scaled":
            if self.gap_scale != 1.0 or self.gap_scale_by_logprob is not None:
                raise ValueError(f"loss_fn.gap_scale / loss_fn.gap_scale_by_logprob act only with "
                                 f"loss_fn.ratio=gap_scaled (got loss_fn.ratio={self.ratio})")
            return
        if self.correction is not None:
            raise ValueError("loss_fn.ratio=gap_scaled is a research knob on the PPO ratio against the generator: "
                             f"set loss_fn.correction=null (got {self.correction})")
        pairs = self.gap_scale_by_logprob or []
        if any(len(p) != 2 for p in pairs) or [p[0] for p in pairs] != sorted(p[0] for p in pairs):
            raise ValueError("loss_fn.gap_scale_by_logprob must be [[lp_max, k], ...] with ascending lp_max, "
                             f"got {self.gap_scale_by_logprob}")
        if self.gap_scale < 0 or any(p[1] < 0 for p in pairs):
            raise ValueError(f"loss_fn.gap_scale and the k of loss_fn.gap_scale_by_logprob must be >= 0, "
                             f"got {self.gap_scale}, {self.gap_scale_by_logprob}")

    def _check_correction(self) -> None:
        if self.correction_mode not in ("decoupled", "bypass"):
            raise ValueError(f"loss_fn.correction_mode must be decoupled or bypass, got {self.correction_mode!r}")
        if self.correction is None:
            return
        names = corrections.names_of(self.correction)
        for name in names or [self.correction]:
            if name not in corrections.CORRECTIONS:
                _bad("correction", name, ["null"] + corrections.CORRECTIONS.names())
        if self.correction_mode == "bypass" and set(names) <= corrections.WEIGHT_ONLY:
            raise ValueError(f"loss_fn.correction={self.correction} with loss_fn.correction_mode=bypass has no effect: "
                             f"the PPO ratio against the generator already carries the importance weight and "
                             f"{self.correction} masks nothing; use loss_fn.correction_mode=decoupled")


def _bad(key: str, value, valid) -> None:
    raise ValueError(f"loss_fn.{key}: unknown value {value!r}; valid choices: {', '.join(valid)}")
