"""Rollout engines (registered by name, imported lazily) and the Megatron -> generator weight path."""

from megatron_grpo.registry import Registry
from megatron_grpo.rollout.types import Rollout, RolloutEngine, Rollouts, Sampling

ROLLOUT_ENGINES = Registry("rollout engine")
ROLLOUT_ENGINES.add("vllm", "megatron_grpo.rollout.engines.vllm_engine:VLLMEngine")
ROLLOUT_ENGINES.add("vllm_server", "megatron_grpo.rollout.engines.vllm_server:VLLMServerEngine")
ROLLOUT_ENGINES.add("megatron", "megatron_grpo.rollout.engines.megatron_engine:MegatronEngine")

__all__ = ["ROLLOUT_ENGINES", "Rollout", "RolloutEngine", "Rollouts", "Sampling"]
