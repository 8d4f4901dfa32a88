"""Memory plan: per-rank device bytes of a run, from the config and the model shape alone.

Pure arithmetic (no torch.distributed, no model building): ``--dry-run`` prints it, and a run
with ``cluster.gpu_memory_gib`` set stops before building anything when it does not fit.

Exact (counted like the built model): parameters, gradients and optimizer state of the
current code. Estimates: activations (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", eq. 1-2: s*b*h*(34 + 5*a*s/h) bytes per layer in
16-bit), the logits and the log-prob chunk buffers (upper bounds: every sequence padded to
``generation.max_model_len``), and the generator (vLLM's reservation, or weights + KV cache).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from megatron_grpo.config import DTYPES, Config
from megatron_grpo.models.qwen3 import ModelShape

GIB = 1024 ** 3
MC = "policy.megatron_cfg."
LAYOUT_KEYS = (MC + "tensor_model_parallel_size", MC + "pipeline_model_parallel_size")
EXPERT_KEYS = (MC + "expert_model_parallel_size", MC + "expert_tensor_parallel_size")
ACTIVATION_KEYS = ("policy.train_micro_batch_size", "generation.max_model_len", MC + "tensor_model_parallel_size",
                   MC + "context_parallel_size")
ADAM_BYTES = 8
"""AdamW's exp_avg + exp_avg_sq, fp32."""
MASTER_BYTES = 4
"""fp32 master copy of a half-precision parameter."""
KORTHIKANTI_REPLICATED, KORTHIKANTI_SHARDED = 10, 24
"""Activation bytes per token per hidden unit of one layer in 16-bit, 34 in all (attention 11, MLP 19,
norms 4): without sequence parallelism 10 are replicated over TP and 24 split by it."""
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
    """Which optimizer column ``total`` counts (cluster.assume_distributed_optimizer)."""
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


def _layer_params(shape: ModelShape, tp: int) -> Tuple[int, int]:
    """(dense, expert-before-EP-split) parameters of one transformer layer at TP = ``tp``, ETP = 1."""
    h, d = shape.hidden_size, shape.head_dim
    qkv = h * (shape.num_heads + 2 * shape.num_kv_heads) * d // tp
    proj = shape.num_heads * d * h // tp
    dense = 2 * h + 2 * d + qkv + proj  # input / pre-MLP norms, q / k norms (replicated over TP)
    if not shape.is_moe:
        return dense + 3 * h * shape.ffn_hidden_size // tp, 0
    return dense + shape.num_experts * h, 3 * h * shape.moe_ffn_hidden_size * shape.num_experts  # router


def count_params(shape: ModelShape, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
                 stage: int = 0) -> ParamCount:
    """Parameters of pipeline ``stage`` on one rank (Megatron's GPTModel for Qwen3 / Qwen3-MoE)."""
    num_layers_local = shape.num_layers // pp
    dense, expert = _layer_params(shape, tp)
    embedding = shape.vocab_size * shape.hidden_size // tp
    num_dense = num_layers_local * dense
    if stage == 0:
        num_dense += embedding
    if stage == pp - 1:
        num_dense += shape.hidden_size  # final norm
        if not shape.tie_word_embeddings or pp > 1:  # a tied output layer on its own stage keeps a copy
            num_dense += embedding
    return ParamCount(num_dense, num_layers_local * expert // (ep * etp))


def optimizer_bytes(count: ParamCount, params_dtype: str, *, dp: int = 1, expert_dp: int = 1) -> float:
    """AdamW state (+ fp32 master weights for half params); ``dp`` / ``expert_dp`` > 1 = Megatron's
    distributed optimizer (ZeRO-1) sharding it over the (expert-)data-parallel group."""
    per_param = ADAM_BYTES + (MASTER_BYTES if DTYPES[params_dtype].itemsize < 4 else 0)
    return per_param * (count.num_dense_local / dp + count.num_expert_local / expert_dp)


def _state_terms(cfg: Config, count: ParamCount, dp: int, expert_dp: int) -> List[Term]:
    dtype = cfg.policy.precision.params_dtype
    size, half = DTYPES[dtype].itemsize, DTYPES[dtype].itemsize < 4
    keys = LAYOUT_KEYS + EXPERT_KEYS + ("policy.precision.params_dtype",)
    grad_note = (f".grad in {dtype}" + (" + fp32 master grads during the step" if half else "") +
                 " (current optimizer; Megatron DDP would keep one fp32 buffer with grad_reduce_in_fp32)")
    return [
        Term("parameters", size * count.num_local, keys,
             f"{count.num_local / 1e9:.3f}B params ({count.num_expert_local / 1e9:.3f}B expert) in {dtype}"),
        Term("gradients", (size + (4 if half else 0)) * count.num_local, keys, grad_note),
        Term("optimizer (replicated)", optimizer_bytes(count, dtype), keys + ("cluster.assume_distributed_optimizer",),
             "AdamW moments" + (" + fp32 master" if half else "") + " on every DP rank (current code)"),
        Term("optimizer (distributed)", optimizer_bytes(count, dtype, dp=dp, expert_dp=expert_dp), keys,
             f"ZeRO-1: dense over DP={dp}, experts over expert-DP={expert_dp} (Megatron's distributed optimizer)"),
    ]


def _num_micro_batches(cfg: Config, dp: int) -> int:
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    return max(1, -(-rows // (dp * cfg.policy.train_micro_batch_size)))


def layer_activation_bytes(cfg: Config, shape: ModelShape) -> Tuple[float, float]:
    """(all, layer input only) activation bytes of one layer for one micro-batch.

    Korthikanti et al. without sequence parallelism (the current code never enables it):
    s*b*h*(10 + 24/t) + 5*a*s^2*b/t bytes in 16-bit, scaled to the compute dtype; the score
    term is dropped with Transformer Engine (flash / fused attention keeps no s x s scores).
    s = ``generation.max_model_len`` / CP (every sequence padded to the longest possible).
    """
    m = cfg.policy.megatron_cfg
    tp, scale = m.tensor_model_parallel_size, DTYPES[cfg.policy.precision.compute_dtype].itemsize / 2
    s, b, h = (cfg.generation.max_model_len / m.context_parallel_size, cfg.policy.train_micro_batch_size,
               shape.hidden_size)
    per_layer = s * b * h * (KORTHIKANTI_REPLICATED + KORTHIKANTI_SHARDED / tp)
    if m.transformer_impl != "te":
        per_layer += KORTHIKANTI_SCORES * shape.num_heads * s * s * b / tp
    return per_layer * scale, 2 * s * b * h * scale


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
    from megatron_grpo.logprobs import DEFAULT_CHUNK_SIZE

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
    """Rank 0 runs the generator on its own device unless a ``vllm_server`` URL points elsewhere."""
    return cfg.generation.backend == "vllm" or cfg.generation.server_url is None


def generator_weight_bytes(cfg: Config, shape: ModelShape) -> float:
    """The whole model in the generation dtype (the engine runs vLLM on one device, TP = 1)."""
    return count_params(shape).num_local * DTYPES[cfg.policy.precision.generation_dtype].itemsize


def _generator_term(cfg: Config, shape: ModelShape, budget_gib) -> Term:
    g = cfg.generation
    keys = ("generation.gpu_memory_utilization", "generation.backend", "generation.server_url")
    if budget_gib is not None:
        return Term("generator (colocated)", g.gpu_memory_utilization * budget_gib * GIB, keys,
                    f"vLLM reserves generation.gpu_memory_utilization={g.gpu_memory_utilization} of the device "
                    "(weights + KV cache)")
    num_seqs = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    size = DTYPES[cfg.policy.precision.generation_dtype].itemsize
    kv = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * g.max_model_len * num_seqs * size
    return Term("generator (colocated)", generator_weight_bytes(cfg, shape) + kv, keys + ("generation.max_model_len",),
                f"estimate: weights + KV cache of {num_seqs} sequences x max_model_len={g.max_model_len}")


def _stage_plan(cfg: Config, shape: ModelShape, world_size: int, stage: int) -> MemoryPlan:
    m = cfg.policy.megatron_cfg
    tp, pp, ep, etp = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size,
                       m.expert_tensor_parallel_size)
    dp, expert_dp = world_size // (tp * pp * m.context_parallel_size), world_size // (ep * etp * pp)
    count = count_params(shape, tp=tp, pp=pp, ep=ep, etp=etp, stage=stage)
    terms = _state_terms(cfg, count, dp, expert_dp) + _activation_terms(cfg, shape, stage, dp)
    if stage == pp - 1:
        terms += _logit_terms(cfg, shape)
    if stage == 0 and generator_colocated(cfg):
        terms.append(_generator_term(cfg, shape, cfg.cluster.gpu_memory_gib))
    return MemoryPlan(stage=stage, num_stages=pp, dp=dp, expert_dp=expert_dp, terms=terms,
                      distributed_optimizer=cfg.cluster.assume_distributed_optimizer,
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
