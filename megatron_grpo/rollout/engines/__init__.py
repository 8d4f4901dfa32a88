"""Generator engines behind ``RolloutEngine``: vLLM offline, vLLM's server (+ worker extension), Megatron.

Registered by dotted path in ``megatron_grpo.rollout`` and imported only when chosen (vLLM is heavy).
"""
