"""megatron-grpo: GRPO on Megatron-Core with precision-matched vLLM rollouts."""
__version__ = "0.1.0"
