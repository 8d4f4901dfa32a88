"""Layer-spec selection: Transformer Engine when TE imports and CUDA is present, else local.

This is the one place that decides. A half-installed TE raises RuntimeError or
FileNotFoundError rather than ImportError, so the probe catches every exception.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def te_usable() -> bool:
    """True when Transformer Engine imports cleanly and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "no TE"
        logger.warning("Transformer Engine not usable (%s: %s); using Megatron's local layers", type(exc).__name__, exc)
        return False
    return True


def layer_spec(num_experts: int | None, backend: str = "auto"):
    """The GPT layer spec for Qwen3 (RMSNorm, QK-norm, SwiGLU, optional MoE).

    ``backend``: ``auto`` (TE if usable), ``te`` (error if not usable) or ``local``.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if backend not in ("auto", "te", "local"):
        raise ValueError(f"policy.megatron_cfg.transformer_impl must be auto, te or local, got {backend!r}")
    use_te = te_usable() if backend == "auto" else backend == "te"
    if use_te and not te_usable():
        raise ValueError("policy.megatron_cfg.transformer_impl='te' but Transformer Engine with CUDA is not usable here")
    experts = num_experts or None
    if use_te:
        logger.info("layer spec: Transformer Engine (TE GEMMs)")
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=True), "te"
    logger.info("layer spec: Megatron-Core local (torch layers)")
    return specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=True, normalization="RMSNorm"), "local"
