"""Layer-spec selection: Transformer Engine when TE imports and CUDA is present, else local.

This is the one place that decides. A half-installed TE raises RuntimeError or
FileNotFoundError rather than ImportError, so the probe catches every exception.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Sequence

import torch

from megatron_grpo.compat.megatron import gpt_layer_spec, te_mla_adds_a_q_norm
from megatron_grpo.models.latent import LATENT_NORM_EPS, adapt_local_latent
from megatron_grpo.models.norm import SequenceParallelRMSNorm

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


def layer_spec(num_experts: int | None, backend: str = "auto", sequence_parallel: bool = False,
               qk_layernorm: bool = True, multi_latent_attention: bool = False):
    """The GPT layer spec for Qwen3 (RMSNorm, QK-norm, SwiGLU, optional MoE) or, without
    ``qk_layernorm``, Llama; with ``multi_latent_attention`` Megatron's ``MLASelfAttention`` (DeepSeek).

    ``backend``: ``auto`` (TE if usable), ``te`` (error if not usable) or ``local``. With
    ``sequence_parallel`` the local spec's norms are ``SequenceParallelRMSNorm`` (Megatron's
    ``WrappedTorchNorm`` refuses SP); TE's norms support SP as they are.
    """
    use_te = _use_te(backend)
    spec = gpt_layer_spec(use_te=use_te, num_experts=num_experts or None, qk_layernorm=qk_layernorm,
                          multi_latent_attention=multi_latent_attention)
    if sequence_parallel and not use_te:
        _use_sequence_parallel_norms(spec, qk_layernorm, multi_latent_attention)
    return spec, "te" if use_te else "local"


def _use_te(backend: str) -> bool:
    if backend not in ("auto", "te", "local"):
        raise ValueError(f"policy.megatron_cfg.transformer_impl must be auto, te or local, got {backend!r}")
    use_te = te_usable() if backend == "auto" else backend == "te"
    if use_te and not te_usable():
        raise ValueError("policy.megatron_cfg.transformer_impl='te' but Transformer Engine with CUDA is not usable here")
    logger.info("layer spec: %s", "Transformer Engine (TE GEMMs)" if use_te else "Megatron-Core local (torch layers)")
    return use_te


def _use_sequence_parallel_norms(spec, qk_layernorm: bool, mla: bool = False) -> None:
    """The local layer spec's norms (input, pre-MLP, QK when present) -> ``SequenceParallelRMSNorm``
    (MLA's latent norms are fused into its up projections: ``models/latent.py``)."""
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
    if qk_layernorm and not mla:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm


def model_spec(config, num_experts: int | None, backend: str = "auto"):
    """What ``GPTModel`` takes as ``transformer_layer_spec``, and the backend chosen: the layer spec,
    or with local layers and sequence parallelism the block's submodules, whose final norm is then
    ``SequenceParallelRMSNorm`` too (for a bare layer spec Megatron picks ``WrappedTorchNorm``). With
    dense and MoE layers mixed (``config.moe_layer_freq`` a list) Megatron's decoder block spec."""
    mla = bool(getattr(config, "multi_latent_attention", False))
    backend = _latent_backend(config, backend) if mla else backend
    if isinstance(config.moe_layer_freq, list):
        use_te = _use_te(backend)
        spec = gpt_layer_spec(use_te=use_te, num_experts=num_experts, block_config=config)
        layers, chosen = list({id(s): s for s in spec.layer_specs}.values()), "te" if use_te else "local"
        if not use_te and config.sequence_parallel:
            for layer in layers:
                _use_sequence_parallel_norms(layer, config.qk_layernorm, mla)
            spec.layer_norm = SequenceParallelRMSNorm
    else:
        spec, chosen = layer_spec(num_experts, backend, sequence_parallel=config.sequence_parallel,
                                  qk_layernorm=config.qk_layernorm, multi_latent_attention=mla)
        layers = [spec]
    if mla and chosen == "local":
        for layer in layers:
            adapt_local_latent(layer, config)
    if chosen != "local" or not config.sequence_parallel or isinstance(config.moe_layer_freq, list):
        return spec, chosen
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layers = [spec] * get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelRMSNorm), chosen


def _latent_backend(config, backend: str) -> str:
    """Where Transformer Engine's MLA would compute another model than HF's: without a q LoRA on a Megatron
    whose TE MLA adds a q norm the checkpoint lacks, or with ``rms_norm_eps`` != the latent norms' 1e-6 (TE's
    fused latent norms take the model's epsilon): local layers (``auto``) or a refusal (``te``)."""
    q_norm = not config.q_lora_rank and te_mla_adds_a_q_norm()
    eps = config.layernorm_epsilon != LATENT_NORM_EPS
    if not (q_norm or eps) or not _use_te_quietly(backend):
        return backend
    why = ("puts a norm in front of q_proj when the model has no q LoRA (q_lora_rank null)" if q_norm else
           f"normalises the q / kv latents with rms_norm_eps={config.layernorm_epsilon}, HF with {LATENT_NORM_EPS}")
    if backend == "te":
        raise ValueError(f"policy.megatron_cfg.transformer_impl=te: this megatron-core's MLA with Transformer Engine "
                         f"{why}: another model than the checkpoint's; use transformer_impl=local (or auto)")
    logger.info("MLA: Megatron's local layers (Transformer Engine's MLA %s)", why)
    return "local"


def _use_te_quietly(backend: str) -> bool:
    return backend == "te" or (backend == "auto" and te_usable())


def resolve_backend(backend: str, compute_dtype: torch.dtype, fp8: bool = False) -> str:
    """The layer backend to build: ``auto`` picks Transformer Engine when usable, except with fp32
    compute, where Megatron's local layers run torch GEMMs with TF32 off (true fp32, as the
    write-up's fp32 trainer; TE's cuBLASLt GEMMs may compute fp32 inputs in TF32), and with ``fp8``
    (an fp8 generator or shadow: ``models/fp8.py`` patches Megatron's local linears; ``te`` is refused
    at config time)."""
    if backend == "auto" and fp8 and te_usable():
        logger.info("fp8 generation / shadow: Megatron's local layers (the FP8 forward runs their linears)")
        return "local"
    if backend == "auto" and compute_dtype == torch.float32 and te_usable():
        logger.info("compute_dtype=float32: Megatron's local layers (true fp32 GEMMs) instead of Transformer Engine")
        return "local"
    if backend == "te" and compute_dtype == torch.float32:
        logger.warning("transformer_impl=te with compute_dtype=float32: TF32 is disabled through "
                       "NVIDIA_TF32_OVERRIDE=0, which TE's cuBLASLt GEMMs honour only if it was set before CUDA "
                       "initialised; use transformer_impl=local for guaranteed fp32 GEMMs")
    return backend


def configure_fp32_matmul(compute_dtype: torch.dtype, fp32_roles: Sequence[str] = ()) -> str:
    """Makes fp32 GEMMs really fp32 on GPU when the trainer computes in fp32 or any of ``fp32_roles``
    (the config keys of other fp32 GEMMs in this process: ``setup.fp32_roles``) needs them: TF32 off
    in torch (matmul, cuDNN) and, for cuBLAS handles created after this call (Transformer Engine's
    included: its cuBLASLt GEMMs default fp32 to TF32), ``NVIDIA_TF32_OVERRIDE=0``. Returns how fp32
    GEMMs run, for the log. A no-op when no role is fp32."""
    roles = list(dict.fromkeys((["policy.precision.compute_dtype"] if compute_dtype == torch.float32 else [])
                               + list(fp32_roles)))
    if not roles:
        return f"{compute_dtype} GEMMs"
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    label = "true fp32 GEMMs (TF32 off)" if os.environ["NVIDIA_TF32_OVERRIDE"] == "0" else (
        "fp32 GEMMs; NVIDIA_TF32_OVERRIDE is set to a non-zero value by the environment: cuBLAS may use TF32")
    logger.info("float32 in %s: %s", ", ".join(roles), label)
    return label
