"""Qwen3 / Qwen3-MoE on Megatron-Core: config mapping, builder, HF weights, tiny test models."""

from __future__ import annotations

import torch

from megatron_grpo.models.qwen3 import ModelShape, build_gpt_model, load_hf_config, shape_from_hf, transformer_config, unwrap


def build_from_hf(model_dir: str, *, params_dtype: torch.dtype = torch.float32, router_dtype: str = "fp32",
                  backend: str = "auto", load_weights: bool = True, moe_aux_loss_coeff: float = 0.0,
                  moe_z_loss_coeff: float = 0.0):
    """Builds this rank's Megatron ``GPTModel`` for an HF Qwen3 checkpoint dir (parallel state must be set).

    Returns ``(model, shape)``; the model holds the checkpoint's weights unless ``load_weights=False``.
    """
    from megatron.core import parallel_state as ps

    from megatron_grpo.models.weights import load_hf_weights

    shape = shape_from_hf(load_hf_config(model_dir))
    tp = ps.get_tensor_model_parallel_world_size()
    if shape.is_moe and tp > 1 and backend != "te":
        raise ValueError("policy.megatron_cfg.tensor_model_parallel_size > 1 with a MoE model needs sequence "
                         "parallelism, which Megatron's local (torch) norm does not support: use "
                         "expert_model_parallel_size instead, or Transformer Engine on GPU")
    if shape.vocab_size % tp:
        raise ValueError(f"policy.megatron_cfg.tensor_model_parallel_size={tp} does not divide vocab_size={shape.vocab_size}")
    config = transformer_config(
        shape, params_dtype=params_dtype, tp=tp, pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
        router_dtype=router_dtype, moe_aux_loss_coeff=moe_aux_loss_coeff, moe_z_loss_coeff=moe_z_loss_coeff,
    )
    model = build_gpt_model(shape, config, backend=backend)
    if load_weights:
        load_hf_weights(model, model_dir, shape)
    return model, shape


def forward_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal forward of ``[B, S]`` ids (right-padded); returns this rank's logits ``[B, S, V/tp]``."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    return model(input_ids, positions, None)


__all__ = ["ModelShape", "build_from_hf", "build_gpt_model", "forward_logits", "load_hf_config", "shape_from_hf",
           "transformer_config", "unwrap"]
