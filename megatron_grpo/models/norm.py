"""A local RMSNorm usable with sequence parallelism (Megatron's local spec refuses it).

Megatron-Core 0.16.1's local layer spec builds its norms with ``WrappedTorchNorm``, which
asserts ``not config.sequence_parallel``: under SP each tensor-parallel rank normalises only
its shard of the sequence, so a norm weight's gradient is a partial sum that must be
all-reduced over TP. Transformer Engine's norms handle this by tagging their parameters
``sequence_parallel = True``; Megatron's ``finalize_model_grads``
(``_allreduce_non_tensor_model_parallel_grads``) then sums the gradients of every tagged
parameter over the TP group. ``SequenceParallelRMSNorm`` is the same ``torch.nn.RMSNorm``
that ``WrappedTorchNorm`` builds, with its weight tagged the same way, so nothing else
changes: same forward, same parameter names, same checkpoint keys.

QK-norm (``q_layernorm`` / ``k_layernorm``, applied per attention head on each rank's
heads) is TP-partial with or without SP; ``finalize_model_grads`` sums it over TP by name,
once, whether or not it is also tagged.
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor signature (a drop-in for
    ``WrappedTorchNorm`` in a ``ModuleSpec``); its weight carries
    ``sequence_parallel = config.sequence_parallel`` so its gradient is all-reduced over TP.

    Input ``[s/tp, b, h]`` (this rank's sequence shard) or any ``[..., hidden_size]``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm: config.normalization={config.normalization!r}, "
                             "expected 'RMSNorm' (Qwen3)")
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("SequenceParallelRMSNorm: zero-centred gamma, persist_layer_norm and "
                             "memory_efficient_layer_norm are not supported (as Megatron's torch norm)")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
