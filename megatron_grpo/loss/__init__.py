"""The GRPO policy loss and its registries (ratio sources, clip variants, corrections,
aggregations, advantage estimators). See ``../shared/MECHANISM.md`` for the maths."""

from megatron_grpo.loss.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages
from megatron_grpo.loss.aggregation import AGGREGATIONS
from megatron_grpo.loss.clips import CLIP_VARIANTS
from megatron_grpo.loss.config import LossConfig
from megatron_grpo.loss.corrections import CORRECTIONS
from megatron_grpo.loss.metrics import deployed_improvement_stats, finalize
from megatron_grpo.loss.policy import policy_loss, policy_loss_stats
from megatron_grpo.loss.ratios import RATIO_SOURCES
from megatron_grpo.loss.stats import StatSet

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "CLIP_VARIANTS", "CORRECTIONS", "RATIO_SOURCES",
    "LossConfig", "StatSet", "deployed_improvement_stats", "finalize", "grpo_advantages",
    "policy_loss", "policy_loss_stats",
]
