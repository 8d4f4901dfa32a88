"""Layer-spec selection: Transformer Engine when TE imports and CUDA is present, else local.

This is the one place that decides. A half-installed TE raises RuntimeError or
FileNotFoundError rather than ImportError, so the probe catches every exception.
"""

from __future__ import annotations

import functools
import logging
import os

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


def resolve_backend(backend: str, compute_dtype: torch.dtype) -> str:
    """The layer backend to build: ``auto`` picks Transformer Engine when usable, except with fp32
    compute, where Megatron's local layers run torch GEMMs with TF32 off (true fp32, as the
    write-up's fp32 trainer; TE's cuBLASLt GEMMs may compute fp32 inputs in TF32)."""
    if backend == "auto" and compute_dtype == torch.float32 and te_usable():
        logger.info("compute_dtype=float32: Megatron's local layers (true fp32 GEMMs) instead of Transformer Engine")
        return "local"
    if backend == "te" and compute_dtype == torch.float32:
        logger.warning("transformer_impl=te with compute_dtype=float32: TF32 is disabled through "
                       "NVIDIA_TF32_OVERRIDE=0, which TE's cuBLASLt GEMMs honour only if it was set before CUDA "
                       "initialised; use transformer_impl=local for guaranteed fp32 GEMMs")
    return backend


def configure_fp32_matmul(compute_dtype: torch.dtype) -> str:
    """Makes fp32 compute really fp32 on GPU: TF32 off in torch (matmul, cuDNN) and, for cuBLAS
    handles created after this call (Transformer Engine's included), ``NVIDIA_TF32_OVERRIDE=0``.
    Returns how fp32 GEMMs run, for the log. A no-op for bf16/fp16 compute."""
    if compute_dtype != torch.float32:
        return f"{compute_dtype} GEMMs"
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    label = "true fp32 GEMMs (TF32 off)" if os.environ["NVIDIA_TF32_OVERRIDE"] == "0" else (
        "fp32 GEMMs; NVIDIA_TF32_OVERRIDE is set to a non-zero value by the environment: cuBLAS may use TF32")
    logger.info("compute_dtype=float32: %s", label)
    return label
