"""Memory plan: per-rank device bytes of a run, from the config and the model shape alone.

Pure arithmetic (no torch.distributed, no model building): ``--dry-run`` prints it, and a run
with ``cluster.gpu_memory_gib`` set stops before building anything when it does not fit.

Exact (counted like the built model and Megatron-Core's allocation, tested on the tiny models):
parameters, gradients (DDP's grad buffer) and optimizer state (Megatron's optimizer, replicated
or distributed; both columns shown, ``total`` counts the recipe's). Estimates: activations
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
eq. 1-2: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, split over TP as sequence parallelism
splits them), the logits and the log-prob chunk
buffers (upper bounds: every sequence padded to ``generation.max_model_len``), and the generator
(vLLM's reservation, or weights + KV cache). Stated allowances: vLLM's nccl packed buffers on rank 0 (their
size is vLLM's default) and a runtime headroom for what no term counts (CUDA context, NCCL, fragmentation).
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from megatron_grpo.config.schema import DTYPES, Config
from megatron_grpo.models.qwen3 import ModelShape, resolve_sequence_parallel
from megatron_grpo.parallel.logprobs import DEFAULT_CHUNK_SIZE
from megatron_grpo.rollout.transfer.transport import resolve_transport

GIB = 1024 ** 3
MC = "policy.megatron_cfg."
LAYOUT_KEYS = (MC + "tensor_model_parallel_size", MC + "pipeline_model_parallel_size")
EXPERT_KEYS = (MC + "expert_model_parallel_size", MC + "expert_tensor_parallel_size")
ACTIVATION_KEYS = ("policy.train_micro_batch_size", "generation.max_model_len", MC + "tensor_model_parallel_size",
                   MC + "context_parallel_size")
MAIN_PARAM_BYTES = 4
"""Megatron's fp32 main copy of a half-precision parameter (master weights)."""
DDP_PARAM_ALIGN, DDP_BUCKET_ALIGN = 64, 128
"""Distributed optimizer only: DDP starts every parameter at a multiple of 64 elements in its buffers
and ends every bucket at a multiple of lcm(DP x CP, 128) (``param_and_grad_buffer.py``)."""
KORTHIKANTI_REPLICATED, KORTHIKANTI_SHARDED = 10, 24
"""Activation bytes per token per hidden unit of one layer in 16-bit, 34 in all (attention 11, MLP 19,
norms 4): without sequence parallelism 10 are replicated over TP and 24 split by it; with it all 34 are split."""
KORTHIKANTI_MLP_REPLICATED, KORTHIKANTI_MLP_SHARDED = 3, 16
"""The MLP's share of those 34: its input and dropout mask (3, replicated over TP), fc1's output and the
activation (16, split by TP); a MoE layer replaces it by its dispatched tokens (``_moe_terms``)."""
KORTHIKANTI_SCORES = 5
"""Attention scores, softmax and its dropout mask: 5*a*s^2*b bytes per layer (not kept by flash attention)."""


@dataclass
class Term:
    """One line of the plan."""

    name: str
    bytes: float
    keys: Tuple[str, ...] = ()
    """The config keys that shrink it."""
    note: str = ""


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
                 stage: int = 0) -> ParamCount:
    """Parameters of pipeline ``stage`` on one rank (Megatron's GPTModel for every family of ``models/families.py``)."""
    num_layers_local = shape.num_layers // pp
    layers = [_layer_params(shape, tp, shape.is_moe_layer(i))
              for i in range(stage * num_layers_local, (stage + 1) * num_layers_local)]
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


def _num_micro_batches(cfg: Config, dp: int) -> int:
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    return max(1, -(-rows // (dp * cfg.policy.train_micro_batch_size)))


def layer_activation_bytes(cfg: Config, shape: ModelShape) -> Tuple[float, float]:
    """(all, layer input only) activation bytes of one layer for one micro-batch.

    Korthikanti et al.: without sequence parallelism s*b*h*(10 + 24/t), with it (the default for
    t > 1, ``policy.megatron_cfg.sequence_parallel``) s*b*h*34/t (the norms', residuals' and
    dropout's 10 are split too, and so are the layer inputs kept for recompute), plus 5*a*s^2*b/t
    bytes in 16-bit, scaled to the compute dtype; the score term is dropped with Transformer Engine
    (flash / fused attention keeps no s x s scores). s = ``generation.max_model_len`` / CP (every
    sequence padded to the longest possible).
    """
    m = cfg.policy.megatron_cfg
    tp, scale = m.tensor_model_parallel_size, DTYPES[cfg.policy.precision.compute_dtype].itemsize / 2
    sp = resolve_sequence_parallel(m.sequence_parallel, tp, shape)
    s, b, h = (cfg.generation.max_model_len / m.context_parallel_size, cfg.policy.train_micro_batch_size,
               shape.hidden_size)
    per_layer = s * b * h * (KORTHIKANTI_REPLICATED / (tp if sp else 1) + KORTHIKANTI_SHARDED / tp)
    if m.transformer_impl != "te":
        per_layer += KORTHIKANTI_SCORES * shape.num_heads * s * s * b / tp
    return per_layer * scale, 2 * s * b * h * scale / (tp if sp else 1)


def _activation_terms(cfg: Config, shape: ModelShape, stage: int, dp: int) -> List[Term]:
    """Activations of the micro-batches in flight (1F1B: stage k holds min(PP - k, micro-batches))."""
    pp = cfg.policy.megatron_cfg.pipeline_model_parallel_size
    num_in_flight = min(pp - stage, _num_micro_batches(cfg, dp))
    per_layer, layer_input = layer_activation_bytes(cfg, shape)
    num_layers_local = shape.num_layers // pp
    where = f"{num_layers_local} layers x {num_in_flight} micro-batch(es) in flight"
    return [
        Term("activations (no recompute)", per_layer * num_layers_local * num_in_flight, ACTIVATION_KEYS,
             f"estimate (Korthikanti et al.), {where}; the current code does not recompute"),
        Term("activations (full recompute)", layer_input * num_layers_local * num_in_flight + per_layer,
             ACTIVATION_KEYS, f"estimate: layer inputs, {where}, + one layer recomputed"),
    ]


def _logit_terms(cfg: Config, shape: ModelShape) -> List[Term]:
    """Last stage: the logits ``[b*s, V/tp]`` and their gradient in the compute dtype, and the log-prob
    kernel's chunk buffers (logprobs.py: one fp32 chunk copy in forward; in backward the fp32 softmax
    chunk and its cast to the logits' dtype, no cast for fp32)."""
    m, p = cfg.policy.megatron_cfg, cfg.policy.precision
    vocab_local = shape.vocab_size / m.tensor_model_parallel_size
    num_tokens = cfg.policy.train_micro_batch_size * cfg.generation.max_model_len / m.context_parallel_size
    size = DTYPES[p.compute_dtype].itemsize
    chunk = min(cfg.policy.logprob_chunk_size or DEFAULT_CHUNK_SIZE, num_tokens)
    return [
        Term("logits + grad", 2 * num_tokens * vocab_local * size, ACTIVATION_KEYS,
             f"estimate: {num_tokens:.0f} tokens x V/tp={vocab_local:.0f} x {size} B, twice"),
        Term("log-prob chunk buffers", chunk * vocab_local * (4 + (size if size < 4 else 0)),
             ("policy.logprob_chunk_size",), f"{chunk:.0f} tokens x V/tp x (4 B fp32{' + cast' if size < 4 else ''})"),
    ]


def generator_colocated(cfg: Config) -> bool:
    """The engines share the trainer's devices (``generation.colocated``) unless servers run elsewhere;
    ``megatron`` has no engine of its own (the trainer's weights; its KV cache lives only while it generates)."""
    return bool(cfg.generation.colocated) and not cfg.generation.urls and cfg.generation.backend != "megatron"


def generator_weight_bytes(cfg: Config, shape: ModelShape) -> float:
    """One engine's weights on one of its devices: the model in the generation dtype over its
    ``generation.tensor_parallel_size`` devices (colocated engine e sits on ranks e*TP ...; more
    engines than devices would share them: the dry run says so)."""
    return (count_params(shape).num_local * DTYPES[cfg.policy.precision.generation_dtype].itemsize
            / cfg.generation.tensor_parallel_size)


def _generator_term(cfg: Config, shape: ModelShape, budget_gib) -> Term:
    g = cfg.generation
    keys = ("generation.gpu_memory_utilization", "generation.backend", "generation.server_url")
    if budget_gib is not None:
        return Term("generator (colocated)", g.gpu_memory_utilization * budget_gib * GIB, keys,
                    f"vLLM reserves generation.gpu_memory_utilization={g.gpu_memory_utilization} of the device "
                    "(weights + KV cache)")
    num_seqs = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    size = DTYPES[cfg.policy.precision.generation_dtype].itemsize
    kv = shape.kv_cache_elements_per_token() * g.max_model_len * num_seqs * size
    return Term("generator (colocated)", generator_weight_bytes(cfg, shape) + kv, keys + ("generation.max_model_len",),
                f"estimate: weights + KV cache of {num_seqs} sequences x max_model_len={g.max_model_len}"
                + (" (MLA: the latent, kv_lora_rank + qk_rope_head_dim per token and layer)" if shape.is_mla else ""))


ROUTE_BYTES = 2
"""Routing records are int16 ``[B, S, L, k]`` (``models/routing.py``)."""
NUM_RECORDED_ROUTES = 3
"""MoE: the shadow's routing and the training forward's used and natural routing, kept for the step's metrics."""


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
    g, size = cfg.generation, DTYPES[cfg.policy.precision.generation_dtype].itemsize
    largest = largest_hf_tensor(shape)
    bucket = g.weight_push_bucket_mb * 2 ** 20 + max(layer_hf_elements(shape), largest) * size
    return Term("weight push buffers", PUSH_BUCKETS_IN_FLIGHT * bucket + 2 * largest * size,
                ("generation.weight_push_bucket_mb",),
                f"stage leaders: {PUSH_BUCKETS_IN_FLIGHT} buckets in flight, each up to {g.weight_push_bucket_mb:g} "
                "MiB + one whole layer (buckets close between layers), + the largest tensor gathered (shards + "
                "full), in the generation dtype; other ranks hold none")


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
    tensor = largest_hf_tensor(shape) * DTYPES[cfg.policy.precision.generation_dtype].itemsize
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


def _moe_terms(cfg: Config, shape: ModelShape, dp: int) -> List[Term]:
    """MoE on top of the dense activation estimate, per MoE layer (DeepSeek's first layers are dense): each
    micro-batch's tokens dispatched to top-k experts (the expert input, fc1's gate+up output and the
    activation, in the compute dtype, expert-TP splitting the FFN), the shared experts' fc1 output and
    activation for every token (TP splitting them), and the router's fp32 logits and probabilities; and
    the routing records of the step."""
    m, p = cfg.policy.megatron_cfg, cfg.policy.precision
    pp = m.pipeline_model_parallel_size
    tokens = cfg.policy.train_micro_batch_size * cfg.generation.max_model_len / m.context_parallel_size
    size, layers = DTYPES[p.compute_dtype].itemsize, -(-shape.num_moe_layers // pp)  # the most on one stage
    f = shape.moe_ffn_hidden_size / m.expert_tensor_parallel_size
    tp = m.tensor_model_parallel_size
    sp = resolve_sequence_parallel(m.sequence_parallel, tp, shape)
    routed = tokens / tp if sp else tokens  # with SP each TP rank routes its shard of the sequence
    per_layer = routed * (shape.moe_topk * (shape.hidden_size + 3 * f) * size + 2 * shape.num_experts * 4)
    per_layer += tokens * 3 * shape.shared_expert_ffn_hidden_size / tp * size  # shared experts: fc1 out + act, all tokens
    dense_mlp = tokens * shape.hidden_size * (KORTHIKANTI_MLP_REPLICATED / (tp if sp else 1)
                                              + KORTHIKANTI_MLP_SHARDED / tp) * size / 2
    per_layer = max(0.0, per_layer - dense_mlp)  # the dense estimate's MLP, which a MoE layer does not have
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt / dp
    num_routes = NUM_RECORDED_ROUTES + (m.moe_routing_replay == "R3")
    route = rows * cfg.generation.max_model_len * layers * shape.moe_topk * ROUTE_BYTES
    return [
        Term("MoE dispatch activations", per_layer * layers * min(pp, _num_micro_batches(cfg, dp)), ACTIVATION_KEYS
             + (MC + "expert_tensor_parallel_size",), f"estimate: {layers} MoE layer(s), top-{shape.moe_topk} dispatched "
             "tokens x (h + 3 x moe_ffn/etp) + fp32 router logits/probs"
             + (" + the shared experts' 3 x ffn/tp" if shape.shared_expert_ffn_hidden_size else "")
             + ", in place of the dense estimate's MLP"),
        Term("routing records", num_routes * route, (MC + "moe_routing_replay", "generation.max_model_len"),
             f"{num_routes} int16 [rows, s, layers, top-k] records (shadow, used, natural"
             + (", R3's generator routes)" if m.moe_routing_replay == "R3" else ")")),
    ]


def _stage_plan(cfg: Config, shape: ModelShape, world_size: int, stage: int) -> MemoryPlan:
    m = cfg.policy.megatron_cfg
    tp, pp, ep, etp = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size,
                       m.expert_tensor_parallel_size)
    dp, expert_dp = world_size // (tp * pp * m.context_parallel_size), world_size // (ep * etp * pp)
    count = count_params(shape, tp=tp, pp=pp, ep=ep, etp=etp, stage=stage)
    terms = _state_terms(cfg, count, dp * m.context_parallel_size, expert_dp) + _activation_terms(cfg, shape, stage, dp)
    if stage == pp - 1:
        terms += _logit_terms(cfg, shape)
    if shape.is_moe:
        terms += _moe_terms(cfg, shape, dp)
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        terms.append(_reference_term(cfg, count))
    if cfg.generation.backend != "megatron":  # the megatron engine uses the trainer's weights: nothing is pushed
        terms.append(_push_term(cfg, shape))
    if stage == 0 and generator_colocated(cfg):
        terms.append(_generator_term(cfg, shape, cfg.cluster.gpu_memory_gib))
    if stage == 0 and _uses_nccl_transport(cfg, world_size):
        terms.append(_packed_term(cfg, shape))
    terms.append(_headroom_term())
    return MemoryPlan(stage=stage, num_stages=pp, dp=dp, expert_dp=expert_dp, terms=terms,
                      distributed_optimizer=cfg.policy.megatron_cfg.optimizer.use_distributed_optimizer,
                      budget_gib=cfg.cluster.gpu_memory_gib)


def memory_plan(cfg: Config, shape: ModelShape, world_size: int) -> MemoryPlan:
    """The plan of the most loaded rank: rank 0 (first stage, embedding, generator) or the last stage."""
    pp = cfg.policy.megatron_cfg.pipeline_model_parallel_size
    return max((_stage_plan(cfg, shape, world_size, s) for s in {0, pp - 1}), key=lambda plan: plan.total)


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
    lines = [f"memory plan (GiB per rank; pipeline stage {plan.stage} of {plan.num_stages}, DP={plan.dp}, "
             f"expert-DP={plan.expert_dp}):", f"  {'term':<30} {'GiB':>9}  note"]
    lines += [f"  {t.name:<30} {t.bytes / GIB:>9.2f}  {t.note}" for t in plan.terms]
    budget = "no check (cluster.gpu_memory_gib: null)" if plan.budget_gib is None else f"{plan.budget_gib:g}"
    lines.append(f"  {'total':<30} {plan.total / GIB:>9.2f}  {optimizer} optimizer, no recompute; budget {budget}")
    return "\n".join(lines)
