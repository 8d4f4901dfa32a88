"""The supported model families (``families.py``) on Megatron-Core: config mapping, builder, HF weights."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_grpo.compat.megatron import rotary_positions
from megatron_grpo.models.qwen3 import (
    ModelShape,
    build_gpt_model,
    load_hf_config,
    model_chunks,
    resolve_sequence_parallel,
    sequence_multiple,
    sequence_parallel_disabled,
    shape_from_hf,
    transformer_config,
    unwrap,
)
from megatron_grpo.models.fp8 import Fp8Recipe, attach_recipe
from megatron_grpo.models.weights import load_hf_weights
from megatron_grpo.parallel.stages import PipelineSplit


def build_from_hf(model_dir: str, *, params_dtype: torch.dtype = torch.float32, router_dtype: str = "fp32",
                  backend: str = "auto", load_weights: bool = True, moe_aux_loss_coeff: float = 0.0,
                  moe_z_loss_coeff: float = 0.0, sequence_parallel: Optional[bool] = None,
                  fp8_training: Optional[Tuple[str, str]] = None, pipeline_split: Optional[PipelineSplit] = None,
                  fp8_recipe: Optional[Fp8Recipe] = None):
    """Builds this rank's Megatron ``GPTModel`` for an HF checkpoint dir of a supported family (parallel
    state must be set).

    ``sequence_parallel``: ``policy.megatron_cfg.sequence_parallel`` (None = on when TP > 1); ``fp8_training``:
    (``policy.megatron_cfg.fp8``, ``fp8_recipe``) for Transformer Engine's FP8 training GEMMs, None = off;
    ``pipeline_split``: how the layers split over the pipeline stages (None: evenly); ``fp8_recipe``:
    ``policy.precision.fp8.recipe()``, the settings of the model's fp8 forwards (``models.forward.fp8_context``;
    the generator's / the shadow's FP8), None: the model cannot run one.
    Returns ``(model, shape)``; the model holds the checkpoint's weights unless ``load_weights=False``. With
    interleaved virtual pipeline stages (``pipeline_split.virtual_pipeline_model_parallel_size`` > 1, parallel
    state initialised with it) the model is the list of this rank's chunks, one per virtual stage
    (``model_chunks``), each holding its own layers' weights.
    """
    from megatron.core import parallel_state as ps

    shape = shape_from_hf(load_hf_config(model_dir))
    tp = ps.get_tensor_model_parallel_world_size()
    if shape.vocab_size % tp:
        raise ValueError(f"policy.megatron_cfg.tensor_model_parallel_size={tp} does not divide vocab_size={shape.vocab_size}")
    config = transformer_config(
        shape, params_dtype=params_dtype, tp=tp, pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
        router_dtype=router_dtype, moe_aux_loss_coeff=moe_aux_loss_coeff, moe_z_loss_coeff=moe_z_loss_coeff,
        sequence_parallel=resolve_sequence_parallel(sequence_parallel, tp, shape), fp8_training=fp8_training,
        pipeline_split=pipeline_split,
    )
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() if config.virtual_pipeline_model_parallel_size else None
    if config.virtual_pipeline_model_parallel_size != vpp:
        raise ValueError(f"policy.megatron_cfg.virtual_pipeline_model_parallel_size="
                         f"{config.virtual_pipeline_model_parallel_size}: parallel state was initialised with {vpp}")
    if vpp and shape.is_moe:
        raise ValueError(f"policy.megatron_cfg.virtual_pipeline_model_parallel_size={vpp} with a MoE model: the "
                         f"routing control (models/routing.py) over several model chunks is not wired; leave it null")
    models = [build_gpt_model(shape, config, backend=backend, vp_stage=v) for v in range(vpp)] if vpp \
        else [build_gpt_model(shape, config, backend=backend)]
    for model in models:
        attach_recipe(model, fp8_recipe)
        if load_weights:
            load_hf_weights(model, model_dir, shape)
    return (models if vpp else models[0]), shape


def forward_logits(model, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   attention_mask: Optional[torch.Tensor] = None, packed_seq_params=None,
                   padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal forward of ``[B, S]`` ids (right-padded); returns this rank's logits ``[B, S, V/tp]``
    (the output layer all-gathers the sequence under sequence parallelism). With SP, Megatron needs
    S to be a multiple of TP: the ids are padded (repeating the last id; under the causal mask later
    positions cannot change earlier ones) and the logits cut back to S. Packed rows
    (``models/packing.py``) come with their ``position_ids`` and a block-diagonal ``attention_mask``
    ``[B, 1, S, S]`` (True = masked; RoPE then rotates each token by its ``position_ids``:
    ``compat.megatron.rotary_positions``) or THD ``packed_seq_params``, already a multiple of TP long.
    ``padding_mask`` ``[B, S]`` (True = padding; MoE models only): the tokens the routers' z-loss and
    aux loss leave out."""
    gpt = unwrap(model)
    seq_len = input_ids.shape[1]
    extra = -seq_len % sequence_multiple(gpt.config)
    kwargs = {"packed_seq_params": packed_seq_params} if packed_seq_params is not None else {}
    if padding_mask is not None and getattr(gpt.config, "num_moe_experts", None):
        kwargs["padding_mask"] = _stage_padding_mask(gpt, padding_mask, extra)
    if position_ids is not None:
        assert not extra, "packed rows are padded to a multiple of TP"
        if packed_seq_params is not None:  # THD: Transformer Engine restarts the rotation per sequence
            return model(input_ids, position_ids, attention_mask, **kwargs)
        with rotary_positions(gpt, position_ids):  # local spec: Megatron's RoPE ignores position_ids
            return model(input_ids, position_ids, attention_mask, **kwargs)
    if extra and gpt.config.pipeline_model_parallel_size > 1:
        raise ValueError(f"forward_logits: sequence length {seq_len} is not a multiple of "
                         f"policy.megatron_cfg.tensor_model_parallel_size={gpt.config.tensor_model_parallel_size} "
                         f"with sequence parallelism and pipeline parallelism (the pipeline's buffers are sized "
                         f"from the batch's length): pad the batch to a multiple of TP")
    if extra:
        input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(-1, extra)], dim=1)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    logits = model(input_ids, positions, None, **kwargs)
    return logits[:, :seq_len] if extra else logits


def _stage_padding_mask(gpt, padding_mask: torch.Tensor, extra: int) -> torch.Tensor:
    """``padding_mask`` as this stage's ``GPTModel`` needs it: the ``extra`` positions ``forward_logits``
    appends are padding; under sequence parallelism the first stage scatters it over TP itself
    (``GPTModel._preprocess``, 0.16.1 and 0.19) but later pipeline stages pass it on whole, so there it
    is this TP rank's shard of the sequence already."""
    from megatron.core import parallel_state as ps

    if extra:
        padding_mask = torch.cat([padding_mask, padding_mask.new_ones((padding_mask.shape[0], extra))], dim=1)
    if gpt.config.sequence_parallel and not gpt.pre_process:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        padding_mask = padding_mask.chunk(tp, dim=1)[rank]
    return padding_mask


__all__ = ["ModelShape", "build_from_hf", "build_gpt_model", "forward_logits", "load_hf_config", "model_chunks",
           "resolve_sequence_parallel", "sequence_multiple", "sequence_parallel_disabled", "shape_from_hf",
           "transformer_config", "unwrap"]
