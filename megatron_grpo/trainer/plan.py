"""Memory plan: per-rank device bytes of a run, from the config and the model shape alone.

Pure arithmetic (no torch.distributed, no model building): ``--dry-run`` prints it, and a run
with ``cluster.gpu_memory_gib`` set stops before building anything when it does not fit.

Exact (counted like the built model and Megatron-Core's allocation, tested on the tiny models):
parameters, gradients (DDP's grad buffer) and optimizer state (Megatron's optimizer, replicated
or distributed; both columns shown, ``total`` counts the recipe's), and the delta push's kept copy of
the shards last sent. Estimates (``plan_activations.py``, for the largest micro-batch of the recipe's
layout: padded rows, a token budget or a packed row): activations (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", eq. 1-2: s*b*h*34 bytes per layer in 16-bit, split
over TP as sequence parallelism splits them), the local spec's attention scores (5*a*s^2*b), the logits
and the log-prob chunk buffers (upper bounds: every sequence as long as ``generation.max_model_len``), and
the generator (vLLM's reservation, or weights + KV cache). Stated allowances: vLLM's nccl packed buffers on
rank 0 (their size is vLLM's default) and a runtime headroom for what no term counts (CUDA context, NCCL,
fragmentation).
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_grpo.config.precision import FP8
from megatron_grpo.config.schema import DTYPES, Config
from megatron_grpo.models.fp8 import quantized_layer_ids
from megatron_grpo.models.qwen3 import ModelShape
from megatron_grpo.rollout.transfer.transport import DIGEST_MAX_NUMEL, resolve_transport
from megatron_grpo.trainer.plan_activations import (Term, activation_terms, logit_terms, moe_terms, stage_layer_ids,
                                                     stage_layers)

GIB = 1024 ** 3
MC = "policy.megatron_cfg."
LAYOUT_KEYS = (MC + "tensor_model_parallel_size", MC + "pipeline_model_parallel_size")
EXPERT_KEYS = (MC + "expert_model_parallel_size", MC + "expert_tensor_parallel_size")
MAIN_PARAM_BYTES = 4
"""Megatron's fp32 main copy of a half-precision parameter (master weights)."""
DDP_PARAM_ALIGN, DDP_BUCKET_ALIGN = 64, 128
"""Distributed optimizer only: DDP starts every parameter at a multiple of 64 elements in its buffers
and ends every bucket at a multiple of lcm(DP x CP, 128) (``param_and_grad_buffer.py``)."""


@dataclass
class ParamCount:
    """Parameters held by one pipeline stage of one rank."""

    num_dense_local: int
    """Not expert-parallel (embedding, attention, norms, router): replicated over data parallelism."""
    num_expert_local: int
    """MoE experts: replicated over the expert-data-parallel group only."""

    @property
    def num_local(self) -> int:
        return self.num_dense_local + self.num_expert_local


@dataclass
class MemoryPlan:
    """The most loaded rank's terms, in bytes."""

    stage: int
    num_stages: int
    dp: int
    expert_dp: int
    terms: List[Term]
    distributed_optimizer: bool
    """Which optimizer column ``total`` counts (policy.megatron_cfg.optimizer.use_distributed_optimizer)."""
    budget_gib: Optional[float] = None
    layers_per_stage: Optional[List[int]] = None
    """Decoder layers of every pipeline stage (uneven with Megatron's uneven-PP keys)."""

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    @property
    def counted(self) -> List[Term]:
        """The terms the total adds up: the chosen optimizer column, activations without recompute
        (the current code does not recompute)."""
        skip = {"optimizer (replicated)" if self.distributed_optimizer else "optimizer (distributed)",
                "activations (full recompute)"}
        return [t for t in self.terms if t.name not in skip]

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.counted)

    def to_dict(self) -> Dict:
        out = {k: v for k, v in asdict(self).items() if k != "terms"}
        out["terms"] = [dict(asdict(t), gib=t.bytes / GIB) for t in self.terms]
        out["total_gib"] = self.total / GIB
        return out


def _layer_params(shape: ModelShape, tp: int, moe: Optional[bool] = None) -> Tuple[int, int]:
    """(dense, expert-before-EP-split) parameters of one transformer layer at TP = ``tp``, ETP = 1; ``moe``:
    whether the layer holds experts (None: the model's, for models without dense layers among MoE ones)."""
    split, replicated = shape.attention_params()
    h, dense = shape.hidden_size, replicated + split // tp
    if not (shape.is_moe if moe is None else moe):
        return dense + 3 * h * shape.ffn_hidden_size // tp, 0
    shared = 3 * h * shape.shared_expert_ffn_hidden_size // tp  # DeepSeek's shared experts: an MLP over TP
    return dense + shape.num_experts * h + shared, 3 * h * shape.moe_ffn_hidden_size * shape.num_experts  # router


def count_params(shape: ModelShape, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
                 stage: int = 0, stage_layers: Optional[Sequence[int]] = None,
                 layer_ids: Optional[Sequence[int]] = None) -> ParamCount:
    """Parameters of pipeline ``stage`` on one rank (Megatron's GPTModel for every family of ``models/families.py``);
    ``stage_layers``: the decoder layers of every stage (None: an even split, layers / PP); ``layer_ids``: the
    stage's global layer indices where they are not one block (interleaved virtual stages)."""
    stage_layers = list(stage_layers) if stage_layers is not None else [shape.num_layers // pp] * pp
    start = sum(stage_layers[:stage])
    ids = range(start, start + stage_layers[stage]) if layer_ids is None else layer_ids
    layers = [_layer_params(shape, tp, shape.is_moe_layer(i)) for i in ids]
    embedding = shape.vocab_size * shape.hidden_size // tp
    num_dense = sum(dense for dense, _ in layers)
    if stage == 0:
        num_dense += embedding
    if stage == pp - 1:
        num_dense += shape.hidden_size  # final norm
        if not shape.tie_word_embeddings or pp > 1:  # a tied output layer on its own stage keeps a copy
            num_dense += embedding
    return ParamCount(num_dense, sum(expert for _, expert in layers) // (ep * etp))


def fused_optimizer_available() -> bool:
    """Megatron-Core takes Transformer Engine's (else Apex's) FusedAdam when importable and falls back
    to torch's AdamW (``megatron/core/optimizer/__init__.py``); only the moments' dtype without master
    weights depends on it."""
    return any(importlib.util.find_spec(name) is not None for name in ("transformer_engine", "apex"))


def grad_dtype(cfg: Config) -> str:
    """Dtype of DDP's grad buffer (``optim.ddp_config``): fp32 with ``grad_reduce_in_fp32`` and master
    weights, else the params' dtype (``master_weights=false``: the optimizer updates the params with it)."""
    p = cfg.policy.precision
    fp32 = cfg.policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32 and p.master_weights
    return "float32" if fp32 else p.params_dtype


def optimizer_state(cfg: Config, fused: Optional[bool] = None) -> Tuple[float, str]:
    """(bytes per parameter, description) of Megatron's optimizer state for the recipe.

    Half params with master weights: an fp32 main copy (``Float16OptimizerWithFloat16Params`` /
    ``DistributedOptimizer``); fp32 params are their own main params. Adam: exp_avg + exp_avg_sq of
    the main params, fp32 with master weights; with ``master_weights=false`` torch's AdamW allocates
    them like the params (bf16), TE's / Apex's FusedAdam in fp32 (``fused``: None = whichever Megatron
    would import here). SGD: one momentum buffer (none at momentum 0). With half gradients and master
    weights (``grad_reduce_in_fp32=false``) the optimizer also keeps an fp32 copy of the gradient
    (``main_param.grad = main_grad.float()``) from the step to the next ``zero_grad``."""
    p, o = cfg.policy.precision, cfg.policy.megatron_cfg.optimizer
    half = DTYPES[p.params_dtype].itemsize < 4
    main = p.master_weights and half
    if o.optimizer == "adam":
        fused = fused_optimizer_available() if fused is None else fused
        moment_dtype = "float32" if p.master_weights or fused else p.params_dtype
        num_moments, name = 2, "Adam moments"
    else:
        moment_dtype = "float32" if p.master_weights else p.params_dtype
        num_moments, name = (1 if o.sgd_momentum else 0), "SGD momentum"
    grad_copy = main and DTYPES[grad_dtype(cfg)].itemsize < 4
    per_param = ((MAIN_PARAM_BYTES if main else 0) + num_moments * DTYPES[moment_dtype].itemsize
                 + (4 if grad_copy else 0))
    parts = ["fp32 main params"] if main else []
    parts += [f"{num_moments} {name} in {moment_dtype}"] if num_moments else []
    parts += ["fp32 copy of the half grads"] if grad_copy else []
    text = " + ".join(parts) or "no state"
    if not half:
        text += " (fp32 params are their own main params)"
    elif not p.master_weights:
        text += " (master_weights=false: no main params)"
    return per_param, text


def optimizer_bytes(count: ParamCount, per_param: float, *, dp: int = 1, expert_dp: int = 1) -> float:
    """``per_param`` bytes (``optimizer_state``) for this rank's parameters; ``dp`` / ``expert_dp`` > 1 =
    Megatron's distributed optimizer (ZeRO-1) sharding them over the (expert-)data-parallel group."""
    return per_param * (count.num_dense_local / dp + count.num_expert_local / expert_dp)


def _state_terms(cfg: Config, count: ParamCount, dp_cp: int, expert_dp: int) -> List[Term]:
    p, m = cfg.policy.precision, cfg.policy.megatron_cfg
    dtype, grads = p.params_dtype, grad_dtype(cfg)
    keys = LAYOUT_KEYS + EXPERT_KEYS + ("policy.precision.params_dtype",)
    per_param, state = optimizer_state(cfg)
    padding = ("" if not m.optimizer.use_distributed_optimizer else
               f" + padding, not counted (< {DDP_PARAM_ALIGN} elements per tensor, < lcm(DP x CP, {DDP_BUCKET_ALIGN}) "
               "per bucket; tiny MoE at DP=2: +0.02%)")
    return [
        Term("parameters", DTYPES[dtype].itemsize * count.num_local, keys,
             f"{count.num_local / 1e9:.3f}B params ({count.num_expert_local / 1e9:.3f}B expert) in {dtype}"
             + (" (DDP's param buffer)" + padding if padding else "")),
        Term("gradients", DTYPES[grads].itemsize * count.num_local,
             keys + ((MC + "distributed_data_parallel_config.grad_reduce_in_fp32",) if grads != dtype else ()),
             f"DDP's grad buffer (main_grad) in {grads}, whole on every rank" + padding),
        Term("optimizer (replicated)", optimizer_bytes(count, per_param),
             keys + (MC + "optimizer.use_distributed_optimizer",), f"{state}, on every DP rank"),
        Term("optimizer (distributed)", optimizer_bytes(count, per_param, dp=dp_cp, expert_dp=expert_dp), keys,
             f"{state}, sharded: dense over DP x CP={dp_cp}, experts over expert-DP={expert_dp}"),
    ]


def generator_colocated(cfg: Config) -> bool:
    """The engines share the trainer's devices (``generation.colocated``) unless servers run elsewhere;
    ``megatron`` has no engine of its own (the trainer's weights; its KV cache lives only while it generates)."""
    return bool(cfg.generation.colocated) and not cfg.generation.urls and cfg.generation.backend != "megatron"


def generator_weight_bytes(cfg: Config, shape: ModelShape) -> float:
    """One engine's weights on one of its devices: the model in the generation dtype over its
    ``generation.tensor_parallel_size`` devices (colocated engine e sits on ranks e*TP ...; more
    engines than devices would share them: the dry run says so). fp8: the quantized linears at 1 B per
    value + a 4 B scale per block, DeepSeek's expert bias in fp32, everything else (embeddings, norms, routers,
    bf16 layers) in bf16."""
    p, total = cfg.policy.precision, count_params(shape).num_local
    if p.generation_dtype != FP8:
        return total * DTYPES[p.generation_dtype].itemsize / cfg.generation.tensor_parallel_size
    recipe = p.fp8.recipe()
    quantized = sum(fp8_layer_elements(shape, i) for i in quantized_layer_ids(shape.num_layers, recipe))
    per_value = 1 + 4 / (recipe.weight_block_size[0] * recipe.weight_block_size[1])
    fp8_bytes = quantized * per_value + fp8_pushed_fp32(cfg, shape)
    return ((total - quantized) * 2 + fp8_bytes) / cfg.generation.tensor_parallel_size


def fp8_pushed_fp32(cfg: Config, shape: ModelShape) -> int:
    """Bytes of DeepSeek's expert bias (a buffer: no parameter count has it), which an FP8 push sends in fp32."""
    fp8 = shape.router_expert_bias and cfg.policy.precision.generation_dtype == FP8
    return 4 * shape.num_moe_layers * shape.num_experts if fp8 else 0


def fp8_layer_elements(shape: ModelShape, layer: int, tp: int = 1, experts_over: int = 1) -> float:
    """Elements of decoder layer ``layer``'s linears, what FP8 quantizes, on one rank: attention's projections
    (or multi-latent attention's), a dense MLP (DeepSeek's first layers too) and shared experts over ``tp``;
    routed experts over ``experts_over`` (EP x ETP); not the router."""
    h = shape.hidden_size
    attention = (shape.attention_params()[0] if shape.is_mla
                 else h * (2 * shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim)
    if not shape.is_moe_layer(layer):
        return (attention + 3 * h * shape.ffn_hidden_size) / tp
    routed = 3 * h * shape.moe_ffn_hidden_size * shape.num_experts
    return (attention + 3 * h * shape.shared_expert_ffn_hidden_size) / tp + routed / experts_over


def fp8_local_elements(cfg: Config, shape: ModelShape) -> float:
    """Elements of this rank's FP8 linears (the quantized layers' attention projections, dense MLPs and shared
    experts over TP, routed experts over EP x ETP, spread over the pipeline stages); 0 without fp8."""
    p, m = cfg.policy.precision, cfg.policy.megatron_cfg
    if not p.uses_fp8:
        return 0.0
    layers = quantized_layer_ids(shape.num_layers, p.fp8.recipe())
    experts_over = m.expert_model_parallel_size * m.expert_tensor_parallel_size
    return sum(fp8_layer_elements(shape, i, m.tensor_model_parallel_size, experts_over)
               for i in layers) / m.pipeline_model_parallel_size


def fp8_value_bytes(cfg: Config) -> float:
    """Bytes per FP8 value with its share of the block's fp32 scale."""
    bn, bk = cfg.policy.precision.fp8.weight_block_size
    return 1 + 4 / (bn * bk)


def fp8_largest_linear(cfg: Config, shape: ModelShape) -> float:
    """Elements of this rank's largest FP8 linear (upper bound: QKV or MLA's largest, a dense, shared or expert fc1)."""
    m, h = cfg.policy.megatron_cfg, shape.hidden_size
    qkv = (shape.largest_attention_tensor() if shape.is_mla else h * (shape.num_heads + 2 * shape.num_kv_heads)
           * shape.head_dim) / m.tensor_model_parallel_size
    return max(qkv, 2 * h * max(shape.ffn_hidden_size, shape.shared_expert_ffn_hidden_size)
               / m.tensor_model_parallel_size, 2 * h * shape.moe_ffn_hidden_size / m.expert_tensor_parallel_size)


def _fp8_forward_term(cfg: Config, shape: ModelShape) -> Term:
    """The FP8 forward (``models.fp8.fp8_forward``: the shadow, the megatron generator, the parity probe's trainer
    side in fp8) holds, while it runs, this rank's FP8 linears quantized (e4m3 + scales) and the fp32 weight of
    the linear running; the megatron fp8 generator holds every one dequantized (its decode loop)."""
    elements, p = fp8_local_elements(cfg, shape), cfg.policy.precision
    held = cfg.generation.backend == "megatron" and p.generation_dtype == FP8
    fp32 = elements if held else fp8_largest_linear(cfg, shape)
    return Term("FP8 forward weights", elements * fp8_value_bytes(cfg) + fp32 * 4,
                ("policy.precision.shadow_dtype", "policy.precision.fp8.num_first_layers_in_bf16") + LAYOUT_KEYS
                + EXPERT_KEYS, f"{elements / 1e9:.3f}B elements of this rank's FP8 linears as e4m3 + scales, and in "
                + ("fp32 (the megatron generator's decode loop holds them)" if held else
                   f"fp32 the largest linear's {fp32 / 1e6:.1f}M, dequantized when it runs") + ", during an FP8 forward")


def _fp8_forward_runs(cfg: Config) -> bool:
    """An FP8 forward runs on the trainer's model: the shadow in fp8, or fp8 generation on the megatron
    generator or in the parity probe's trainer side."""
    p, g = cfg.policy.precision, cfg.generation
    return p.shadow_dtype == FP8 or (p.generation_dtype == FP8 and (g.backend == "megatron" or g.parity_probe_every > 0))


def generation_itemsize(cfg: Config) -> int:
    """Bytes per element of the generator's activations, KV cache and pushed tensors: the generation dtype's;
    bf16 for fp8 (what runs around its FP8 GEMMs; an upper bound for the pushed linears: 1 B + scales)."""
    gen = cfg.policy.precision.generation_dtype
    return 2 if gen == FP8 else DTYPES[gen].itemsize


def _generator_term(cfg: Config, shape: ModelShape, budget_gib) -> Term:
    g = cfg.generation
    keys = ("generation.gpu_memory_utilization", "generation.backend", "generation.server_url")
    if budget_gib is not None:
        return Term("generator (colocated)", g.gpu_memory_utilization * budget_gib * GIB, keys,
                    f"vLLM reserves generation.gpu_memory_utilization={g.gpu_memory_utilization} of the device "
                    "(weights + KV cache)")
    num_seqs = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    size = generation_itemsize(cfg)
    kv = shape.kv_cache_elements_per_token() * g.max_model_len * num_seqs * size
    return Term("generator (colocated)", generator_weight_bytes(cfg, shape) + kv, keys + ("generation.max_model_len",),
                f"estimate: weights + KV cache of {num_seqs} sequences x max_model_len={g.max_model_len}"
                + (" (MLA: the latent, kv_lora_rank + qk_rope_head_dim per token and layer)" if shape.is_mla else ""))


def largest_hf_tensor(shape: ModelShape) -> int:
    """Elements of the largest full (unsharded) HF tensor: what a push gathers at once."""
    h = shape.hidden_size
    return max(shape.vocab_size * h, shape.largest_attention_tensor(),
               shape.ffn_hidden_size * h if not shape.is_moe or shape.first_dense_layers else 0,
               max(shape.moe_ffn_hidden_size, shape.shared_expert_ffn_hidden_size) * h)


def layer_hf_elements(shape: ModelShape) -> int:
    """Elements of the largest decoder layer's HF tensors (attention, norms, the MLP or all experts, the
    shared experts, the router and its bias)."""
    h, attention = shape.hidden_size, sum(shape.attention_params())
    dense = attention + 3 * shape.ffn_hidden_size * h
    if not shape.is_moe:
        return dense
    moe = (attention + shape.num_experts * (3 * shape.moe_ffn_hidden_size * h + h + shape.router_expert_bias)
           + 3 * shape.shared_expert_ffn_hidden_size * h)
    return max(moe, dense) if shape.first_dense_layers else moe


PUSH_BUCKETS_IN_FLIGHT = 4
"""Buckets alive on a sender at once: the one being filled, up to two queued per engine stream
(``fanout.fan_out_streams``; files: two published unread) and the one being sent."""


def _push_term(cfg: Config, shape: ModelShape) -> Term:
    """A stage leader during the weight push: ``PUSH_BUCKETS_IN_FLIGHT`` buckets plus the tensor being
    gathered (its shards and the unsharded result), in the generation dtype. A bucket closes only
    between layers, so it can hold the size limit plus one whole layer (a MoE layer's experts: GiBs)."""
    g, size = cfg.generation, generation_itemsize(cfg)
    largest = largest_hf_tensor(shape)
    bucket = g.weight_push_bucket_mb * 2 ** 20 + max(layer_hf_elements(shape), largest) * size
    return Term("weight push buffers", PUSH_BUCKETS_IN_FLIGHT * bucket + 2 * largest * size,
                ("generation.weight_push_bucket_mb",),
                f"stage leaders: {PUSH_BUCKETS_IN_FLIGHT} buckets in flight, each up to {g.weight_push_bucket_mb:g} "
                "MiB + one whole layer (buckets close between layers), + the largest tensor gathered (shards + "
                "full), in the generation dtype; other ranks hold none")


def gathered_checksummed_elements(shape: ModelShape, *, tp: int = 1, ep: int = 1, etp: int = 1,
                                  digest_max_numel: int = DIGEST_MAX_NUMEL, num_layers: Optional[int] = None) -> int:
    """Elements of the HF tensors a delta push's sender keeps whole (``DeltaState.fulls``): gathered from
    several ranks (TP-split dense tensors at TP > 1, experts at EP x ETP > 1) and at most ``digest_max_numel``
    (checksummed: completed from that copy where only the changed values travelled); ``num_layers``: a
    pipeline stage's decoder layers (default all; the embedding and output layer are counted either way)."""
    h, d = shape.hidden_size, shape.head_dim
    num_layers = shape.num_layers if num_layers is None else num_layers
    dense, experts = [], []
    if tp > 1:
        dense = [shape.vocab_size * h] * (1 if shape.tie_word_embeddings else 2)
        layer = [shape.num_heads * d * h, shape.num_kv_heads * d * h, shape.num_kv_heads * d * h, shape.num_heads * d * h]
        layer += [] if shape.is_moe else [shape.ffn_hidden_size * h] * 3
        dense += layer * num_layers
    if shape.is_moe and ep * etp > 1:
        experts = [shape.moe_ffn_hidden_size * h] * (3 * shape.num_experts * num_layers)
    return sum(n for n in dense + experts if n <= digest_max_numel)


def _delta_term(cfg: Config, shape: ModelShape, count: ParamCount, num_layers: int) -> Term:
    """``generation.delta_push`` on a stage leader (rank 0 at PP = 1; each stage's leader pushes its own
    layers at PP > 1): the shards it sends as last sent, whole copies of the small gathered tensors of its
    ``num_layers`` layers, and the change masks of the largest tensor being gathered (uint8, shards and whole)."""
    m, size = cfg.policy.megatron_cfg, generation_itemsize(cfg)
    whole = gathered_checksummed_elements(shape, tp=m.tensor_model_parallel_size, ep=m.expert_model_parallel_size,
                                          etp=m.expert_tensor_parallel_size, num_layers=num_layers)
    fp8 = fp8_local_elements(cfg, shape) if cfg.policy.precision.generation_dtype == FP8 else 0.0
    kept = size * (count.num_local - fp8 + whole) + fp8_value_bytes(cfg) * fp8 + fp8_pushed_fp32(cfg, shape)
    return Term("delta push copy", kept + 2 * largest_hf_tensor(shape),
                ("generation.delta_push",) + LAYOUT_KEYS + EXPERT_KEYS,
                f"stage leaders: their shards as last sent ({count.num_local / 1e9:.3f}B elements) + {whole / 1e6:.3g}M elements "
                f"of gathered tensors <= {DIGEST_MAX_NUMEL} elements kept whole, in the generation dtype, + the uint8 "
                "change masks of the largest tensor gathered; every other rank sending to it keeps its own shards")


VLLM_PACKED_BUFFER_BYTES, VLLM_PACKED_NUM_BUFFERS = GIB, 2
"""vLLM's nccl weight transfer (``distributed/weight_transfer/packed_tensor.py``, DEFAULT_PACKED_BUFFER_SIZE_BYTES
and DEFAULT_PACKED_NUM_BUFFERS, which our ``NCCLTrainerInitInfo`` keeps): trainer rank 0 packs the pushed tensors
into this many uint8 buffers in flight, each closed once it exceeds the size (so up to one tensor more)."""
RUNTIME_HEADROOM_BYTES = 4 * GIB
"""Per rank, what no term counts: the CUDA context with cuBLAS / Transformer Engine workspaces (~1 GiB on an
H100), NCCL's communicator buffers (Megatron's TP / DP / EP / expert-DP / PP groups and rank 0's group with the
generator, a few hundred MiB each, more with NVLink SHARP) and the caching allocator's fragmentation (a few % of
the device; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lowers it). A stated allowance, not a measurement."""


def _uses_nccl_transport(cfg: Config, world_size: int) -> bool:
    """The push goes through vLLM's nccl engine on a GPU cluster (``generation.weight_transfer`` nccl, or
    auto with dedicated ``vllm_server`` engines)."""
    g = cfg.generation
    if g.backend == "megatron" or g.weight_transfer not in ("auto", "nccl"):
        return False
    return resolve_transport(g.weight_transfer, g.backend, colocated=bool(g.colocated), cuda=True,
                             trainer_ranks=world_size, num_engines=g.num_engines,
                             tensor_parallel_size=g.tensor_parallel_size) == "nccl"


def _packed_term(cfg: Config, shape: ModelShape) -> Term:
    tensor = largest_hf_tensor(shape) * generation_itemsize(cfg)
    return Term("vLLM nccl packed buffers", VLLM_PACKED_NUM_BUFFERS * (VLLM_PACKED_BUFFER_BYTES + tensor),
                ("generation.weight_transfer",),
                f"trainer rank 0 only: vLLM's nccl transfer packs the push into {VLLM_PACKED_NUM_BUFFERS} buffers of "
                f"{VLLM_PACKED_BUFFER_BYTES / GIB:g} GiB in flight, each up to the largest tensor more")


def _headroom_term() -> Term:
    return Term("runtime headroom", RUNTIME_HEADROOM_BYTES, (),
                "stated allowance: CUDA context + workspaces, NCCL communicator buffers, allocator fragmentation")


def _reference_term(cfg: Config, count: ParamCount) -> Term:
    dtype = cfg.policy.precision.params_dtype
    return Term("reference model", DTYPES[dtype].itemsize * count.num_local, ("loss_fn.reference_policy_kl_penalty",)
                + LAYOUT_KEYS + EXPERT_KEYS, f"a frozen copy of this rank's parameters in {dtype} (no grads, no state)")


def _stage_plan(cfg: Config, shape: ModelShape, world_size: int, stage: int) -> MemoryPlan:
    m = cfg.policy.megatron_cfg
    tp, pp, ep, etp = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size,
                       m.expert_tensor_parallel_size)
    dp, expert_dp = world_size // (tp * pp * m.context_parallel_size), world_size // (ep * etp * pp)
    layers = stage_layers(cfg, shape)
    count = count_params(shape, tp=tp, pp=pp, ep=ep, etp=etp, stage=stage, stage_layers=layers,
                         layer_ids=stage_layer_ids(cfg, shape, stage))
    terms = _state_terms(cfg, count, dp * m.context_parallel_size, expert_dp) + activation_terms(cfg, shape, stage, dp)
    if stage == pp - 1:
        terms += logit_terms(cfg, shape)
    if shape.is_moe:
        terms += moe_terms(cfg, shape, dp, stage)
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        terms.append(_reference_term(cfg, count))
    if cfg.generation.backend != "megatron":  # the megatron engine uses the trainer's weights: nothing is pushed
        terms.append(_push_term(cfg, shape))
    if cfg.generation.delta_push:  # every stage's leader pushes its own layers, with their kept copy
        terms.append(_delta_term(cfg, shape, count, layers[stage]))
    if _fp8_forward_runs(cfg):
        terms.append(_fp8_forward_term(cfg, shape))
    if stage == 0 and generator_colocated(cfg):
        terms.append(_generator_term(cfg, shape, cfg.cluster.gpu_memory_gib))
    if stage == 0 and _uses_nccl_transport(cfg, world_size):
        terms.append(_packed_term(cfg, shape))
    terms.append(_headroom_term())
    return MemoryPlan(stage=stage, num_stages=pp, dp=dp, expert_dp=expert_dp, terms=terms,
                      distributed_optimizer=cfg.policy.megatron_cfg.optimizer.use_distributed_optimizer,
                      budget_gib=cfg.cluster.gpu_memory_gib, layers_per_stage=layers)


def memory_plan(cfg: Config, shape: ModelShape, world_size: int) -> MemoryPlan:
    """The plan of the most loaded rank: rank 0 (first stage, embedding, generator), the last stage, or
    (uneven PP) a stage between with more layers; the first of equals."""
    pp = cfg.policy.megatron_cfg.pipeline_model_parallel_size
    return max((_stage_plan(cfg, shape, world_size, s) for s in range(pp)), key=lambda plan: plan.total)


def check_fits(plan: MemoryPlan, cfg: Config, shape: ModelShape) -> None:
    """``ValueError`` naming the biggest term and the keys to change when the plan exceeds
    ``cluster.gpu_memory_gib`` (or the colocated generator's weights exceed its share)."""
    budget = plan.budget_gib
    if budget is None:
        return
    g = cfg.generation
    if generator_colocated(cfg) and generator_weight_bytes(cfg, shape) > g.gpu_memory_utilization * budget * GIB:
        raise ValueError(
            f"memory plan: the generator's weights ({generator_weight_bytes(cfg, shape) / GIB:.1f} GiB, one device) "
            f"exceed generation.gpu_memory_utilization x cluster.gpu_memory_gib = {g.gpu_memory_utilization} x "
            f"{budget:g} GiB; raise generation.gpu_memory_utilization or run the generator on its own devices "
            "(generation.backend=vllm_server with generation.server_url)")
    if plan.total <= budget * GIB:
        return
    biggest = max(plan.counted, key=lambda t: t.bytes)
    raise ValueError(
        f"memory plan: {plan.total / GIB:.1f} GiB per rank (pipeline stage {plan.stage}) exceeds "
        f"cluster.gpu_memory_gib={budget:g}; the biggest term is {biggest.name} ({biggest.bytes / GIB:.1f} GiB): "
        f"change {', '.join(biggest.keys)}")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a text table (GiB per rank)."""
    optimizer = "distributed" if plan.distributed_optimizer else "replicated"
    layers = f", {plan.layers_per_stage[plan.stage]} of {sum(plan.layers_per_stage)} layers" \
        if plan.layers_per_stage else ""
    lines = [f"memory plan (GiB per rank; pipeline stage {plan.stage} of {plan.num_stages}{layers}, DP={plan.dp}, "
             f"expert-DP={plan.expert_dp}):", f"  {'term':<30} {'GiB':>9}  note"]
    lines += [f"  {t.name:<30} {t.bytes / GIB:>9.2f}  {t.note}" for t in plan.terms]
    budget = "no check (cluster.gpu_memory_gib: null)" if plan.budget_gib is None else f"{plan.budget_gib:g}"
    lines.append(f"  {'total':<30} {plan.total / GIB:>9.2f}  {optimizer} optimizer, no recompute; budget {budget}")
    return "\n".join(lines)
