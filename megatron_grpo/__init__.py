"""megatron-grpo: GRPO on Megatron-Core with precision-matched vLLM rollouts."""
__version__ = "0.1.0"

from megatron_grpo import te_guard as _te_guard

_te_guard.install()  # a half-installed Transformer Engine must not break `import megatron.core`
