"""Qwen3 / Qwen3-MoE / Llama Hugging Face configs -> Megatron-Core ``GPTModel``.

Llama (``LlamaForCausalLM``: SmolLM2, Llama 2/3 without rope scaling) is Qwen3 without QK-norm:
``ModelShape.qk_norm`` is the one switch; GQA, tied or untied embeddings, rope theta and RMSNorm eps
come from the config as for Qwen3."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_grpo.compat.megatron import fp8_training_fields, gpt_model
from megatron_grpo.models.spec import model_spec

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")


@dataclass
class ModelShape:
    """The subset of a Qwen3 / Llama HF config the builder and the weight maps need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    qk_norm: bool = True
    """RMSNorm on each head's queries and keys (Qwen3: ``q_norm`` / ``k_norm``); Llama has none."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def load_hf_config(model_dir: str) -> Dict[str, Any]:
    """Reads ``config.json`` of an HF checkpoint dir; clear error when missing."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"policy.model_name: no HF config at {path}")
    with open(path) as f:
        return json.load(f)


def shape_from_hf(cfg: Dict[str, Any]) -> ModelShape:
    """Extracts a ``ModelShape`` from an HF config dict (Qwen3, Qwen3-MoE or Llama)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    _check_supported(cfg, model_type, rope)
    shape = ModelShape(
        model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=model_type != "llama",
    )
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("qwen3_moe with mlp_only_layers / decoder_sparse_step != 1 is not supported")
        shape.num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
        shape.moe_topk = cfg["num_experts_per_tok"]
        shape.moe_ffn_hidden_size = cfg["moe_intermediate_size"]
        shape.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
    return shape


def _check_supported(cfg: Dict[str, Any], model_type: str, rope: Dict[str, Any]) -> None:
    """What the builder does not map is refused by name (a silently different model otherwise)."""
    rope_type = rope.get("rope_type") or rope.get("type")
    unsupported = {"rope scaling " + repr(rope_type): rope_type not in (None, "default"),
                   "attention_bias": bool(cfg.get("attention_bias")), "mlp_bias": bool(cfg.get("mlp_bias")),
                   "hidden_act " + repr(cfg.get("hidden_act")): cfg.get("hidden_act", "silu") != "silu"}
    found = [name for name, bad in unsupported.items() if bad]
    if found:
        raise ValueError(f"model_type {model_type!r} with {', '.join(found)} is not supported (only plain rope, "
                         f"no linear biases, SiLU)")


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
                       fp8_training: Optional[Tuple[str, str]] = None):
    """A Megatron ``TransformerConfig`` equivalent to the HF Qwen3 / Llama architecture. ``fp8_training``:
    (format, recipe) of Transformer Engine's FP8 training GEMMs (``policy.megatron_cfg.fp8`` / ``fp8_recipe``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: Dict[str, Any] = {}
    if shape.is_moe:
        moe = dict(
            num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            # softmax over all experts then top-k; renormalised top-k == softmax over the top-k logits
            moe_router_pre_softmax=not shape.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_dtype=router_dtype, moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coeff, moe_z_loss_coeff=moe_z_loss_coeff or None,
            moe_grouped_gemm=False,
        )
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, sequence_parallel=sequence_parallel,
        calculate_per_token_loss=True, init_method_std=0.02, pipeline_dtype=params_dtype if pp > 1 else None, **moe,
        **(fp8_training_fields(*fp8_training) if fp8_training else {}),
    )


def build_gpt_model(shape: ModelShape, config, *, backend: str = "auto"):
    """Builds this rank's ``GPTModel`` stage; wraps it in ``Float16Module`` for half params."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    spec, chosen = model_spec(config, shape.num_experts, backend)
    model = gpt_model(
        config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=shape.rope_theta, rotary_percent=1.0,
    )
    model.megatron_grpo_backend = chosen
    for name, param in model.named_parameters():
        if ".experts." in name:  # Megatron marks them only when EP > 1; ETP shards need it too
            param.allreduce = False  # DDP: reduce over expert-DP; optimizer and grad norm: expert params
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
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
