"""Which HF tensors each Megatron parameter of a rank comes from, and how it is split over TP.

A ``ParamMap`` says, for one Megatron parameter (or the router's expert-bias buffer), which HF
tensors it comes from and how it is split across tensor-parallel ranks:

- ``rep``: replicated (norms, router, expert bias, TE's duplicated MLA down projections);
  ``column`` / ``vocab``: split along dim 0; ``row``: split along dim 1;
- ``qkv``: Megatron's fused QKV weight or bias, rows grouped per KV group as
  ``[q (heads/groups * d); k (d); v (d)]`` for each group, TP splits whole groups;
- ``glu``: fused ``[gate; up]`` whose TP shard is ``[gate_shard; up_shard]`` (not a plain
  split of the fused weight).

Multi-latent attention (DeepSeek-V3, Megatron's ``MLASelfAttention``) needs no fusing: ``q_a_proj``
-> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``, ``q_b_proj`` -> ``linear_q_up_proj`` (or
``q_proj`` -> ``linear_q_proj`` without a q LoRA), ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj``,
``kv_a_layernorm`` -> ``kv_layernorm``, ``kv_b_proj`` -> ``linear_kv_up_proj``, ``o_proj`` -> ``linear_proj``.
Both lay the rope part of a head out interleaved and de-interleave it before rotating (HF's
``rope_interleave``, Megatron's MLA ``apply_rotary_pos_emb``), so the rows map one to one. The local
spec's down projections are column-parallel (their outputs gathered), TE's are duplicated; both fuse
the latent norms into the up projections (``layer_norm_weight``; local: ``models/latent.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_grpo.models.families import ModelShape
from megatron_grpo.models.qwen3 import unwrap


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and its HF source tensors."""

    mcore_name: str
    hf_names: Tuple[str, ...]
    kind: str
    """rep | column | vocab | row | qkv | glu"""
    expert: bool = False
    tied_copy: bool = False
    """The last pipeline stage's copy of tied embeddings (loaded, never exported)."""


def _attention_maps(shape: ModelShape, hf: str, mc: str, te: bool) -> List[ParamMap]:
    """One layer's attention: input norm, (fused) QKV with its bias, QK-norms, output projection."""
    maps = [
        ParamMap(mc + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
                 (hf + "input_layernorm.weight",), "rep"),
        ParamMap(mc + "self_attention.linear_qkv.weight", tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    ]
    if shape.qkv_bias:  # Qwen2
        maps.append(ParamMap(mc + "self_attention.linear_qkv.bias", tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"),
                             "qkv"))
    if shape.qk_norm:  # Qwen3; Llama has none
        maps += [ParamMap(mc + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "rep"),
                 ParamMap(mc + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "rep")]
    maps.append(ParamMap(mc + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "row"))
    return maps


def _latent_attention_maps(shape: ModelShape, hf: str, mc: str, te: bool) -> List[ParamMap]:
    """One layer's multi-latent attention (see the module doc)."""
    a, s = mc + "self_attention.", hf + "self_attn."
    down = "rep" if te else "column"
    maps = [ParamMap(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "rep")]
    if shape.q_lora_rank:
        maps += [ParamMap(a + "linear_q_down_proj.weight", (s + "q_a_proj.weight",), down),
                 ParamMap(a + "linear_q_up_proj.layer_norm_weight", (s + "q_a_layernorm.weight",), "rep"),
                 ParamMap(a + "linear_q_up_proj.weight", (s + "q_b_proj.weight",), "column")]
    else:
        maps.append(ParamMap(a + "linear_q_proj.weight", (s + "q_proj.weight",), "column"))
    return maps + [
        ParamMap(a + "linear_kv_down_proj.weight", (s + "kv_a_proj_with_mqa.weight",), down),
        ParamMap(a + "linear_kv_up_proj.layer_norm_weight", (s + "kv_a_layernorm.weight",), "rep"),
        ParamMap(a + "linear_kv_up_proj.weight", (s + "kv_b_proj.weight",), "column"),
        ParamMap(a + "linear_proj.weight", (s + "o_proj.weight",), "row"),
    ]


def _moe_maps(shape: ModelShape, hf: str, mc: str, local_experts: Sequence[int]) -> List[ParamMap]:
    """One MoE layer: router (and its expert bias), shared experts, this rank's routed experts."""
    moe = hf + shape.moe_prefix + "."
    maps = [ParamMap(mc + "mlp.router.weight", (moe + "gate.weight",), "rep")]
    if shape.router_expert_bias:  # a buffer of Megatron's router, fp32
        maps.append(ParamMap(mc + "mlp.router.expert_bias", (moe + "gate.e_score_correction_bias",), "rep"))
    if shape.shared_expert_ffn_hidden_size:  # an MLP over TP, not an expert (no EP / ETP)
        shared = moe + "shared_experts."
        maps += [ParamMap(mc + "mlp.shared_experts.linear_fc1.weight",
                          (shared + "gate_proj.weight", shared + "up_proj.weight"), "glu"),
                 ParamMap(mc + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), "row")]
    gate, up, down = shape.expert_proj
    for local_e, e in enumerate(local_experts):
        he, me = moe + f"experts.{e}.", mc + f"mlp.experts.local_experts.{local_e}."
        maps.append(ParamMap(me + "linear_fc1.weight", (he + f"{gate}.weight", he + f"{up}.weight"), "glu", True))
        maps.append(ParamMap(me + "linear_fc2.weight", (he + f"{down}.weight",), "row", True))
    return maps


def _layer_maps(shape: ModelShape, layer: int, local_layer: int, backend: str, local_experts: Sequence[int]) -> List[ParamMap]:
    hf, mc = f"model.layers.{layer}.", f"decoder.layers.{local_layer}."
    te = backend == "te"
    maps = (_latent_attention_maps if shape.is_mla else _attention_maps)(shape, hf, mc, te)
    moe = shape.is_moe_layer(layer)
    norm = "mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"
    maps.append(ParamMap(mc + norm, (hf + "post_attention_layernorm.weight",), "rep"))
    if moe:
        return maps + _moe_maps(shape, hf, mc, local_experts)
    maps.append(ParamMap(mc + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "glu"))
    maps.append(ParamMap(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row"))
    return maps


@dataclass(frozen=True)
class RankPlacement:
    """Where this rank sits: which layers and experts it holds, and its TP/ETP coordinates."""

    tp_rank: int = 0
    tp: int = 1
    etp_rank: int = 0
    etp: int = 1
    ep_rank: int = 0
    ep: int = 1
    layer_offset: int = 0
    num_local_layers: int = -1
    pre_process: bool = True
    post_process: bool = True
    backend: str = "local"

    @classmethod
    def current(cls, model) -> "RankPlacement":
        """The placement of the calling rank for ``model``, one model chunk with interleaved virtual stages
        (reads Megatron's parallel state; a chunk's layer offset is its virtual stage's)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        gpt = unwrap(model)
        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(), etp=ps.get_expert_tensor_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(), ep=ps.get_expert_model_parallel_world_size(),
            layer_offset=get_transformer_layer_offset(gpt.config, vp_stage=getattr(gpt, "vp_stage", None)),
            num_local_layers=len(gpt.decoder.layers),
            pre_process=gpt.pre_process, post_process=gpt.post_process,
            backend=getattr(gpt, "megatron_grpo_backend", "local"),
        )

    def local_experts(self, shape: ModelShape) -> List[int]:
        per_rank = shape.num_experts // self.ep
        return list(range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank))


def param_maps(shape: ModelShape, place: RankPlacement) -> List[ParamMap]:
    """Every parameter this rank holds, in a fixed order shared by all ranks of a stage."""
    maps: List[ParamMap] = []
    if place.pre_process:
        maps.append(ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    num_local = shape.num_layers if place.num_local_layers < 0 else place.num_local_layers
    experts = place.local_experts(shape) if shape.is_moe else []
    for i in range(num_local):
        maps.extend(_layer_maps(shape, place.layer_offset + i, i, place.backend, experts))
    if place.post_process:
        maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "rep"))
        if not shape.tie_word_embeddings:
            maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not place.pre_process:  # PP > 1: Megatron keeps a synchronised copy on the last stage
            maps.append(ParamMap("output_layer.weight", ("model.embed_tokens.weight",), "vocab", tied_copy=True))
    return maps


MAPPED_BUFFERS = ("router.expert_bias",)
"""Buffers (not parameters) that hold checkpoint tensors: DeepSeek's ``e_score_correction_bias``."""


def model_tensors(model) -> Dict[str, torch.Tensor]:
    """The parameters of this rank's ``GPTModel`` and the buffers in ``MAPPED_BUFFERS``, by name."""
    gpt = unwrap(model)
    tensors: Dict[str, torch.Tensor] = dict(gpt.named_parameters())
    tensors.update((n, b) for n, b in gpt.named_buffers() if b is not None and n.endswith(MAPPED_BUFFERS))
    return tensors

