"""HF configs of the supported families (``models/families.py``: Qwen3 / Qwen3-MoE / Llama / Qwen2 /
Mistral / Mixtral / DeepSeek-V3) -> Megatron-Core ``GPTModel``.

Llama (``LlamaForCausalLM``: SmolLM2, Llama 2/3 without rope scaling) is Qwen3 without QK-norm:
``ModelShape.qk_norm`` is the one switch; GQA, tied or untied embeddings, rope theta and RMSNorm eps
come from the config as for Qwen3. The other families switch on Megatron's own options: QKV bias,
sliding window, MoE layer pattern, shared experts, router score function / expert bias / groups, and
multi-latent attention (``MLATransformerConfig`` with Megatron's ``MLASelfAttention``)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_grpo.compat.megatron import fp8_training_fields, gpt_model, mask_padding_in_expert_counts
from megatron_grpo.models.families import SUPPORTED_MODEL_TYPES, ModelShape, load_hf_config, shape_from_hf
from megatron_grpo.models.spec import model_spec
from megatron_grpo.parallel.stages import PipelineSplit

logger = logging.getLogger(__name__)

SEQUENCE_PARALLEL_KEY = "policy.megatron_cfg.sequence_parallel"


def resolve_sequence_parallel(sequence_parallel: Optional[bool], tp: int, shape: ModelShape) -> bool:
    """Whether the model runs with sequence parallelism: ``None`` (the default) = on when
    ``tp > 1``. MoE with TP > 1 needs it (Megatron-Core's MoE layer refuses to train without);
    at TP = 1 it does nothing (a warning says so)."""
    if sequence_parallel is None:
        return tp > 1
    if tp == 1:
        if sequence_parallel:
            logger.warning("%s=true has no effect with tensor_model_parallel_size=1", SEQUENCE_PARALLEL_KEY)
        return False
    if not sequence_parallel and shape.is_moe:
        raise ValueError(f"{SEQUENCE_PARALLEL_KEY}=false with a MoE model and "
                         f"policy.megatron_cfg.tensor_model_parallel_size={tp}: Megatron-Core's MoE layer needs "
                         f"sequence parallelism to train with TP > 1; leave it null (on for TP > 1) or true")
    return bool(sequence_parallel)


def sequence_multiple(config) -> int:
    """The multiple a forward's sequence length must be: TP with sequence parallelism (the
    sequence is split over the TP ranks), else 1."""
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def transformer_config(shape: ModelShape, *, params_dtype: torch.dtype = torch.float32, tp: int = 1, pp: int = 1,
                       ep: int = 1, etp: int = 1, router_dtype: str = "fp32", moe_aux_loss_coeff: float = 0.0,
                       moe_z_loss_coeff: float = 0.0, sequence_parallel: bool = False,
                       fp8_training: Optional[Tuple[str, str]] = None, pipeline_split: Optional[PipelineSplit] = None):
    """A Megatron ``TransformerConfig`` (``MLATransformerConfig`` for multi-latent attention) equivalent to
    the HF architecture ``shape`` describes. ``fp8_training``: (format, recipe) of Transformer Engine's FP8
    training GEMMs (``policy.megatron_cfg.fp8`` / ``fp8_recipe``); ``pipeline_split``: the layers' split over
    the ``pp`` stages (None: even)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    moe = _moe_options(shape, router_dtype, moe_aux_loss_coeff, moe_z_loss_coeff) if shape.is_moe else {}
    config_cls = MLATransformerConfig if shape.is_mla else TransformerConfig
    return config_cls(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.v_head_dim if shape.is_mla else shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, sequence_parallel=sequence_parallel,
        calculate_per_token_loss=True, init_method_std=0.02, pipeline_dtype=params_dtype if pp > 1 else None,
        **_window_options(shape), **_mla_options(shape), **moe,
        **(fp8_training_fields(*fp8_training) if fp8_training else {}),
        **(pipeline_split or PipelineSplit()).config_kwargs(pp), **_p2p_options(pipeline_split),
    )


def _p2p_options(split: Optional[PipelineSplit]) -> Dict[str, Any]:
    """Interleaved virtual stages off CUDA: Megatron's unbatched point-to-point ops. Its batched ones
    (``batch_isend_irecv``) are matched as one group only by NCCL; gloo matches each send to a receive from
    the same rank in posting order, and at PP = 2 (the previous stage is the next) the interleaved schedule's
    steady state posts an activation and a gradient each way at once, in an order the peer does not mirror:
    same-shaped tensors are swapped silently. The unbatched ops order them by rank parity and send the two
    directions over different groups (``p2p_communication._p2p_ops``)."""
    if split is None or split.vpp == 1 or torch.cuda.is_available():
        return {}
    return dict(batch_p2p_comm=False)


def _moe_options(shape: ModelShape, router_dtype: str, aux_loss_coeff: float, z_loss_coeff: float) -> Dict[str, Any]:
    """The router and experts: softmax (Qwen3-MoE, Mixtral) or sigmoid with an expert bias and groups
    (DeepSeek-V3), shared experts, the first dense layers. The expert bias stays the checkpoint's
    (update rate 0: the generator routes with the pushed bias, and RL fine-tuning keeps the base model's
    balance, as NeMo-RL's default)."""
    return dict(
        num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        # softmax over all experts then top-k; renormalised top-k == softmax over the top-k logits
        moe_router_pre_softmax=shape.router_score_function == "softmax" and not shape.norm_topk_prob,
        moe_router_score_function=shape.router_score_function,
        moe_router_enable_expert_bias=shape.router_expert_bias, moe_router_bias_update_rate=0.0,
        moe_router_num_groups=shape.router_num_groups or None, moe_router_group_topk=shape.router_group_topk or None,
        moe_router_topk_scaling_factor=shape.router_scaling_factor if shape.router_scaling_factor != 1.0 else None,
        moe_shared_expert_intermediate_size=shape.shared_expert_ffn_hidden_size or None,
        moe_layer_freq=[int(shape.is_moe_layer(i)) for i in range(shape.num_layers)] if shape.first_dense_layers else 1,
        moe_router_dtype=router_dtype, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff, moe_z_loss_coeff=z_loss_coeff or None, moe_grouped_gemm=False,
    )


def _window_options(shape: ModelShape) -> Dict[str, Any]:
    """HF's sliding window of ``w`` keys (the query's own included) is Megatron's ``window_size=(w - 1, 0)``,
    on the layers ``window_attn_skip_freq`` marks (a per-layer list; None = every layer)."""
    if not shape.sliding_window:
        return {}
    layers = [int(w) for w in shape.window_layers] if shape.window_layers else None
    return dict(window_size=(shape.sliding_window - 1, 0), window_attn_skip_freq=layers)


def _mla_options(shape: ModelShape) -> Dict[str, Any]:
    """Multi-latent attention: latent ranks, the no-rope and rope parts of a query / key head, the value
    head, and the rope (Megatron's MLA builds its own rotary embedding from these, not GPTModel's)."""
    if not shape.is_mla:
        return {}
    yarn = dict(shape.yarn)
    rope = dict(rope_type="yarn", rotary_scaling_factor=yarn.pop("factor"), **yarn) if yarn else dict(rope_type="rope")
    return dict(q_lora_rank=shape.q_lora_rank or None, kv_lora_rank=shape.kv_lora_rank,
                qk_head_dim=shape.qk_nope_head_dim, qk_pos_emb_head_dim=shape.qk_rope_head_dim,
                v_head_dim=shape.v_head_dim, rotary_base=shape.rope_theta, **rope)


def build_gpt_model(shape: ModelShape, config, *, backend: str = "auto", vp_stage: Optional[int] = None):
    """Builds this rank's ``GPTModel`` stage (with interleaved virtual stages: its model chunk ``vp_stage``,
    which holds the embedding / the output layer only as the first / last virtual stage of the first / last
    pipeline stage); wraps it in ``Float16Module`` for half params. The routers' expert bias (DeepSeek's
    ``e_score_correction_bias``) stays fp32, as transformers and vLLM hold it and Megatron's router keeps it
    from its first forward on: in the wrapper's half dtype the checkpoint's values would load rounded."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    spec, chosen = model_spec(config, shape.num_experts, backend)
    virtual = {} if vp_stage is None else {"vp_stage": vp_stage}
    model = gpt_model(
        config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=shape.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=shape.rope_theta, rotary_percent=1.0, **virtual,
    )
    model.megatron_grpo_backend = chosen
    for name, param in model.named_parameters():
        if ".experts." in name:  # Megatron marks them only when EP > 1; ETP shards need it too
            param.allreduce = False  # DDP: reduce over expert-DP; optimizer and grad norm: expert params
    routers = [m for m in model.modules() if getattr(m, "enable_expert_bias", False)]
    for router in routers:
        mask_padding_in_expert_counts(router)
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    for router in routers:  # Float16Module casts every buffer: the expert bias stays fp32 (HF's, vLLM's)
        router.expert_bias.data = router.expert_bias.data.float()
    return model


SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
"""The module attributes Megatron's ``set_model_to_sequence_parallel`` switches (``transformer/utils.py``)."""


@contextlib.contextmanager
def sequence_parallel_disabled(model):
    """The enclosed forwards run without sequence parallelism (every TP rank holds the whole
    sequence), as Megatron-Core's inference runs its non-MoE layers: a KV-cached decode step of one
    token cannot be split over TP ranks. Eval mode only for MoE (its layer refuses to *train* with
    TP > 1 without SP). Every attribute switched off is switched back on afterwards."""
    gpt = unwrap(model)
    if not gpt.config.sequence_parallel:
        yield
        return
    switched = [(m, a) for m in gpt.modules() for a in SEQUENCE_PARALLEL_ATTRS if getattr(m, a, None) is True]
    for module, attr in switched:
        setattr(module, attr, False)
    gpt.config.sequence_parallel = False  # one config object, shared by every submodule
    try:
        yield
    finally:
        gpt.config.sequence_parallel = True
        for module, attr in switched:
            setattr(module, attr, True)


def unwrap(model):
    """The ``GPTModel`` inside Float16Module / DDP wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_chunks(model) -> list:
    """This rank's model chunks: the list itself with interleaved virtual pipeline stages (one chunk per
    virtual stage, in order), else ``[model]``."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


__all__ = ["SUPPORTED_MODEL_TYPES", "ModelShape", "build_gpt_model", "load_hf_config", "model_chunks",
           "resolve_sequence_parallel",
           "sequence_multiple", "sequence_parallel_disabled", "shape_from_hf", "transformer_config", "unwrap"]
