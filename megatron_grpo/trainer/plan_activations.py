"""Memory plan, the terms that grow with a micro-batch's tokens: activations, attention scores, logits,
MoE dispatch and routing records (``plan.py`` adds them up). Pure arithmetic, like ``plan.py``.

A micro-batch's size comes from how the step lays out its sequences (``models/packing.py``):
padded rows (``policy.train_micro_batch_size`` rows of ``generation.max_model_len``), token-budget
micro-batches (``policy.dynamic_batching.max_tokens_per_microbatch``, padded rows; a sequence longer
than the budget gets a micro-batch of its own) or one packed row (``policy.sequence_packing.train_mb_tokens``,
never shorter than the longest sequence). Every bound takes the longest possible sequence,
``generation.max_model_len``. On the local spec a packed row's attention covers the whole row
(the block-diagonal mask hides scores, it does not skip them): W^2 scores for a row of W tokens where the
same tokens padded to rows of ``max_model_len`` would cost W x max_model_len.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from megatron_grpo.config.schema import DTYPES, Config
from megatron_grpo.models.qwen3 import ModelShape, resolve_sequence_parallel
from megatron_grpo.parallel.logprobs import DEFAULT_CHUNK_SIZE

MC = "policy.megatron_cfg."
KORTHIKANTI_REPLICATED, KORTHIKANTI_SHARDED = 10, 24
"""Activation bytes per token per hidden unit of one layer in 16-bit, 34 in all (attention 11, MLP 19,
norms 4): without sequence parallelism 10 are replicated over TP and 24 split by it; with it all 34 are split."""
KORTHIKANTI_MLP_REPLICATED, KORTHIKANTI_MLP_SHARDED = 3, 16
"""The MLP's share of those 34: its input and dropout mask (3, replicated over TP), fc1's output and the
activation (16, split by TP); a MoE layer replaces it by its dispatched tokens (``_moe_terms``)."""
KORTHIKANTI_SCORES = 5
"""Attention scores, softmax and its dropout mask: 5*a*s^2*b bytes per layer (not kept by flash attention)."""
ROW_MULTIPLE = 8
"""Token-budget and packed rows are a multiple of this (times TP under sequence parallelism): ``step.plan_spec``."""
ROUTE_BYTES = 2
"""Routing records are int16 ``[B, S, L, k]`` (``models/routing.py``)."""
NUM_RECORDED_ROUTES = 3
"""MoE: the shadow's routing and the training forward's used and natural routing, kept for the step's metrics."""


@dataclass
class Term:
    """One line of the plan."""

    name: str
    bytes: float
    keys: Tuple[str, ...] = ()
    """The config keys that shrink it."""
    note: str = ""


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch of the recipe's layout, per context-parallel rank."""

    mode: str
    """padded | token budget | packed"""
    num_tokens: float
    """rows x width / CP"""
    width: float
    """the longest row / CP: attention scores are num_tokens x width (rows x width^2)"""
    keys: Tuple[str, ...]
    """the config keys that shrink it"""

    @property
    def num_scores(self) -> float:
        """Attention scores per head (sum over rows of width^2)."""
        return self.num_tokens * self.width


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def micro_batch(cfg: Config, shape: ModelShape) -> MicroBatch:
    """The largest micro-batch: padded ``b`` rows of ``L = max_model_len``; a token budget B holds max(B, L)
    tokens in rows no wider than L; a packed row of W = max(train_mb_tokens, L) tokens (rounded as the step
    rounds rows)."""
    p, m = cfg.policy, cfg.policy.megatron_cfg
    length, cp = cfg.generation.max_model_len, m.context_parallel_size
    tp = m.tensor_model_parallel_size
    multiple = ROW_MULTIPLE * (tp if resolve_sequence_parallel(m.sequence_parallel, tp, shape) else 1)
    common = ("generation.max_model_len", MC + "tensor_model_parallel_size", MC + "context_parallel_size")
    if p.sequence_packing.enabled:
        row = _round_up(max(p.sequence_packing.train_mb_tokens, length), multiple)
        return MicroBatch("packed", row / cp, row / cp, ("policy.sequence_packing.train_mb_tokens",) + common)
    if p.dynamic_batching.enabled:
        budget = max(p.dynamic_batching.max_tokens_per_microbatch, _round_up(length, multiple))
        return MicroBatch("token budget", budget / cp, length / cp,
                          ("policy.dynamic_batching.max_tokens_per_microbatch",) + common)
    return MicroBatch("padded", p.train_micro_batch_size * length / cp, length / cp,
                      ("policy.train_micro_batch_size",) + common)


def num_micro_batches_in_flight(cfg: Config, dp: int, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once, in whole-stage units. 1F1B: min(PP - k, M).
    Interleaved (V model chunks per stage): Megatron's warmup of 2 (PP - k - 1) + (V - 1) PP chunk forwards plus
    the one in 1F1B, at most M V, each chunk 1/V of the stage's layers (stage 0: PP (1 + (PP - 1) / (PP V)) when
    M is large). Every micro-batch holds at least one sequence."""
    m = cfg.policy.megatron_cfg
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    per_batch = 1 if cfg.policy.sequence_packing.enabled or cfg.policy.dynamic_batching.enabled \
        else cfg.policy.train_micro_batch_size
    pp, vpp, num = m.pipeline_model_parallel_size, m.pipeline_split.vpp, max(1, -(-rows // (dp * per_batch)))
    if vpp == 1:
        return min(pp - stage, num)
    return min(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, num * vpp) / vpp


def _scale(cfg: Config) -> float:
    return DTYPES[cfg.policy.precision.compute_dtype].itemsize / 2


def layer_activation_bytes(cfg: Config, shape: ModelShape) -> Tuple[float, float]:
    """(all but the attention scores, layer input only) activation bytes of one layer for the largest micro-batch.

    Korthikanti et al.: without sequence parallelism T*h*(10 + 24/t), with it (the default for t > 1,
    ``policy.megatron_cfg.sequence_parallel``) T*h*34/t (the norms', residuals' and dropout's 10 are split
    too, and so are the layer inputs kept for recompute) for T = s*b tokens, in 16-bit, scaled to the
    compute dtype. The scores (5*a*s^2*b/t) are ``layer_score_bytes``."""
    m = cfg.policy.megatron_cfg
    tp = m.tensor_model_parallel_size
    sp = resolve_sequence_parallel(m.sequence_parallel, tp, shape)
    tokens_h = micro_batch(cfg, shape).num_tokens * shape.hidden_size
    per_layer = tokens_h * (KORTHIKANTI_REPLICATED / (tp if sp else 1) + KORTHIKANTI_SHARDED / tp)
    return per_layer * _scale(cfg), 2 * tokens_h * _scale(cfg) / (tp if sp else 1)


def layer_score_bytes(cfg: Config, shape: ModelShape) -> float:
    """Attention scores, softmax and dropout mask of one layer: 5*a*(scores per head)/t bytes in 16-bit (local
    spec: rows x width^2; a packed row's full W^2); 0 with Transformer Engine (flash / fused attention keeps no
    scores)."""
    m = cfg.policy.megatron_cfg
    if m.transformer_impl == "te":
        return 0.0
    scores = micro_batch(cfg, shape).num_scores
    return KORTHIKANTI_SCORES * shape.num_heads * scores / m.tensor_model_parallel_size * _scale(cfg)


def _packing_note(cfg: Config, mb: MicroBatch) -> str:
    """Packed rows on the local spec: W^2 scores per head against W x L for the same tokens padded."""
    if mb.mode != "packed":
        return ""
    length = cfg.generation.max_model_len / cfg.policy.megatron_cfg.context_parallel_size
    padded = mb.num_tokens * length
    verdict = (f"packing costs {mb.num_scores / padded:.3g}x padding" if mb.num_scores > padded
               else "packing costs no more than padding")
    return (f"; a packed row of {mb.width:.0f} tokens attends over the whole row: {mb.num_scores / 1e6:.4g}M scores "
            f"per head vs {padded / 1e6:.4g}M for the same tokens padded to rows of max_model_len: {verdict} "
            "(transformer_impl=te keeps none)")


def stage_layers(cfg: Config, shape: ModelShape) -> List[int]:
    """Decoder layers of each pipeline stage (``policy.megatron_cfg``'s uneven-PP keys, else even)."""
    m = cfg.policy.megatron_cfg
    return m.pipeline_split.layers_per_stage(shape.num_layers, m.pipeline_model_parallel_size)


def stage_layer_ids(cfg: Config, shape: ModelShape, stage: int) -> List[int]:
    """The global indices of pipeline stage ``stage``'s decoder layers (one block per virtual stage's chunk)."""
    m = cfg.policy.megatron_cfg
    split, pp = m.pipeline_split, m.pipeline_model_parallel_size
    chunks, offsets = split.chunk_layers(shape.num_layers, pp)[stage], split.chunk_offsets(shape.num_layers, pp)[stage]
    return [first + i for first, n in zip(offsets, chunks) for i in range(n)]


def activation_terms(cfg: Config, shape: ModelShape, stage: int, dp: int) -> List[Term]:
    """Activations and attention scores of the micro-batches in flight, with and without recompute."""
    num_in_flight = num_micro_batches_in_flight(cfg, dp, stage)
    per_layer, layer_input = layer_activation_bytes(cfg, shape)
    scores = layer_score_bytes(cfg, shape)
    num_layers_local = stage_layers(cfg, shape)[stage]
    mb = micro_batch(cfg, shape)
    where = (f"{num_layers_local} layers x {num_in_flight:g} micro-batch(es) in flight of {mb.num_tokens:.0f} "
             f"tokens ({mb.mode})")
    terms = [
        Term("activations (no recompute)", per_layer * num_layers_local * num_in_flight, mb.keys,
             f"estimate (Korthikanti et al.), {where}; the current code does not recompute"),
        Term("activations (full recompute)", layer_input * num_layers_local * num_in_flight + per_layer + scores,
             mb.keys, f"estimate: layer inputs, {where}, + one layer recomputed"),
    ]
    if scores:
        terms.append(Term("attention scores (local)", scores * num_layers_local * num_in_flight,
                          mb.keys + (MC + "transformer_impl",),
                          f"local spec: 5 x heads x {mb.num_scores / 1e6:.4g}M scores per head / TP, {where}"
                          + _packing_note(cfg, mb)))
    return terms


def logit_terms(cfg: Config, shape: ModelShape) -> List[Term]:
    """Last stage: the logits ``[T, V/tp]`` and their gradient in the compute dtype, and the log-prob
    kernel's chunk buffers (logprobs.py: one fp32 chunk copy in forward; in backward the fp32 softmax
    chunk and its cast to the logits' dtype, no cast for fp32)."""
    m, p = cfg.policy.megatron_cfg, cfg.policy.precision
    vocab_local = shape.vocab_size / m.tensor_model_parallel_size
    mb = micro_batch(cfg, shape)
    size = DTYPES[p.compute_dtype].itemsize
    chunk = min(cfg.policy.logprob_chunk_size or DEFAULT_CHUNK_SIZE, mb.num_tokens)
    return [
        Term("logits + grad", 2 * mb.num_tokens * vocab_local * size, mb.keys,
             f"estimate: {mb.num_tokens:.0f} tokens ({mb.mode}) x V/tp={vocab_local:.0f} x {size} B, twice"),
        Term("log-prob chunk buffers", chunk * vocab_local * (4 + (size if size < 4 else 0)),
             ("policy.logprob_chunk_size",), f"{chunk:.0f} tokens x V/tp x (4 B fp32{' + cast' if size < 4 else ''})"),
    ]


def moe_terms(cfg: Config, shape: ModelShape, dp: int, stage: int = 0) -> List[Term]:
    """MoE on top of the dense activation estimate, per MoE layer of pipeline ``stage`` (DeepSeek's first
    layers are dense): each micro-batch's tokens dispatched to top-k experts (the expert input, fc1's gate+up
    output and the activation, in the compute dtype, expert-TP splitting the FFN), the shared experts' fc1
    output and activation for every token (TP splitting them), and the router's fp32 logits and
    probabilities; and the routing records of the step (laid out like the padded batch, whatever the
    micro-batches)."""
    m, p = cfg.policy.megatron_cfg, cfg.policy.precision
    mb = micro_batch(cfg, shape)
    size = DTYPES[p.compute_dtype].itemsize
    layers = sum(shape.is_moe_layer(i) for i in stage_layer_ids(cfg, shape, stage))  # this stage's MoE layers
    f = shape.moe_ffn_hidden_size / m.expert_tensor_parallel_size
    tp = m.tensor_model_parallel_size
    sp = resolve_sequence_parallel(m.sequence_parallel, tp, shape)
    routed = mb.num_tokens / tp if sp else mb.num_tokens  # with SP each TP rank routes its shard of the sequence
    per_layer = routed * (shape.moe_topk * (shape.hidden_size + 3 * f) * size + 2 * shape.num_experts * 4)
    per_layer += mb.num_tokens * 3 * shape.shared_expert_ffn_hidden_size / tp * size  # shared experts, all tokens
    dense_mlp = mb.num_tokens * shape.hidden_size * (KORTHIKANTI_MLP_REPLICATED / (tp if sp else 1)
                                                     + KORTHIKANTI_MLP_SHARDED / tp) * size / 2
    per_layer = max(0.0, per_layer - dense_mlp)  # the dense estimate's MLP, which a MoE layer does not have
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt / dp
    num_routes = NUM_RECORDED_ROUTES + (m.moe_routing_replay == "R3")
    route = rows * cfg.generation.max_model_len * layers * shape.moe_topk * ROUTE_BYTES
    return [
        Term("MoE dispatch activations", per_layer * layers * num_micro_batches_in_flight(cfg, dp, 0),
             mb.keys + (MC + "expert_tensor_parallel_size",), f"estimate: {layers} MoE layer(s), top-{shape.moe_topk} "
             "dispatched tokens x (h + 3 x moe_ffn/etp) + fp32 router logits/probs"
             + (" + the shared experts' 3 x ffn/tp" if shape.shared_expert_ffn_hidden_size else "")
             + ", in place of the dense estimate's MLP"),
        Term("routing records", num_routes * route, (MC + "moe_routing_replay", "generation.max_model_len"),
             f"{num_routes} int16 [rows, s, layers, top-k] records (shadow, used, natural"
             + (", R3's generator routes)" if m.moe_routing_replay == "R3" else ")")),
    ]
