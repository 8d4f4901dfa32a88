"""Megatron rollout engine (``generation.backend: megatron``): the trainer's own model generates.

Why a decode loop of our own over Megatron-Core's KV cache, not Megatron's inference engine:
Megatron-Core 0.16.1's ``StaticInferenceEngine`` (legacy or over ``DynamicInferenceEngine``)
does not run on CPU (``TextGenerationController.generate_all_output_tokens_static_batch``
calls ``.cuda()``, measured), and its sampling contract is not ours: one sampling RNG for the
whole batch (results depend on which requests share a batch), one termination id, log-probs
of its own. So the loop is ours, and the KV cache is Megatron's: ``StaticInferenceContext``
passed to ``GPTModel.forward`` (prefill, then one token per forward; keys and values cached
per layer, on any device). Measured on the tiny Qwen3, 64 completions x 16 tokens: KV-cached
0.27 s vs 0.62 s recomputing the prefix each token. The price of exact batch independence
(below): rows share a batch only with rows of the same prompt length, so many distinct prompt
lengths mean many small batches; vLLM remains the engine for throughput.

Contract (that of ``rollout/types.py``, as the vLLM engine):

- dtype: ``policy.precision.generation_dtype``, through the trainer's ``precision_context``; fp8: bf16 around
  the FP8 linears (``fp8_context``), the weights quantized once per ``generate`` call, so the decode loop and
  the scoring forward run on the same bytes (those the shadow forward of the same weights quantizes).
- seeds: completion i of prompt p samples with its own generator seeded ``seed + p * n + i``
  (exponential race over ``softmax(logits / T)`` in fp32, vLLM's method), and rows are batched
  only with rows of the same prompt length; results do not depend on batch composition.
- log-probs: ``log_softmax(logits / T)`` of each sampled token in fp32, computed after the
  decode loop by one forward of the finished sequences with the trainer's own
  ``forward_log_probs`` (vocab-parallel over TP), packed at the whole batch's width as the
  trainer packs it: they equal the trainer's log-probs bit for bit (beta, the parity probe and
  ``policy/kl_rollout`` are 0 with matched dtypes). The tokens were drawn from the KV-cached
  logits of the same weights in the same dtype; the two differ only by kernel round-off
  (``decode_gap_max`` on the tiny model: fp32 <= 2 ulp, 1e-6; bf16 3e-3, the usual bf16 spread).
- stops: ``stop_token_ids`` and the model's ``eos_token_id`` (included in the completion,
  ``finish_reason="stop"``); ``max_tokens`` or ``max_model_len`` give ``"length"``; with
  ``ignore_eos`` nothing stops a completion before ``max_tokens``.
- top-p / top-k: not supported (``ValueError``): the trainer does not truncate.

Parallelism: the model is sharded over TP (and EP), so every rank holds this engine and calls
it with the same inputs (``shares_trainer_weights``: ``setup._build_megatron_engine`` builds it on
every rank). Dense models (expert collectives local) shard the completions over DP: each DP rank
decodes and scores its contiguous slice, gathered in order. With expert parallelism the
all-to-alls span DP ranks, so every rank runs every row, the sampled tokens broadcast from
rank 0 each step so that all ranks run the same forwards.

Weights and versions: no push (``update_weights`` only records the version). A generation
runs when it is submitted, with the weights of that moment, and carries that version:
``submit_generate`` returns an already finished handle, so ``max_staleness = k`` still trains
step s on rollouts of version s - k (honest lags), without overlapping generation and training.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state as ps

from megatron_grpo.compat.megatron import keep_kv_rows, static_inference_context
from megatron_grpo.models import sequence_parallel_disabled
from megatron_grpo.models.forward import (
    PackedBatch,
    completion_scores,
    forward_log_probs,
    fp8_context,
    model_device,
    pack,
    precision_context,
)
from megatron_grpo.parallel import comm
from megatron_grpo.parallel.logprobs import token_log_probs
from megatron_grpo.rollout.types import Rollout, RolloutEngine, Rollouts, Sampling

logger = logging.getLogger(__name__)


ScoreLayout = Callable[[List[int], PackedBatch], Tuple[object, list]]
"""(sequence lengths, the whole packed batch) -> (this rank's rows: a slice or an index tensor, their
micro-batches): ``TrainStep.score_layout``."""


@dataclass
class _Row:
    """One completion being generated (completion i of prompt p: seeded ``seed + p * n + i``)."""

    prompt: List[int]
    generator: torch.Generator
    tokens: List[int] = field(default_factory=list)
    decode_logprobs: List[float] = field(default_factory=list)
    """Log-probs under the KV-cached logits it was sampled from (for ``decode_gap_max``)."""
    finish_reason: Optional[str] = None


class MegatronEngine(RolloutEngine):
    """Generates with the trainer's Megatron ``GPTModel`` (no copy of the weights)."""

    shares_trainer_weights = True

    def __init__(self, model_dir: str, dtype: torch.dtype, *, model, params_dtype: torch.dtype = torch.float32,
                 max_model_len: int = 512, seed: int = 0, micro_batch_size: int = 8, pad_id: int = 0,
                 gpu_memory_utilization: Optional[float] = None, kv_cache_gib: Optional[int] = None,
                 is_moe: bool = False, score_layout: Optional[ScoreLayout] = None, score_group=None):
        """``model``: this rank's trainer model; ``micro_batch_size``: rows per scoring forward (the
        trainer's); ``gpu_memory_utilization`` / ``kv_cache_gib`` / ``is_moe`` are vLLM's, unused.
        ``score_layout`` (the trainer's ``TrainStep.score_layout``, with packing or token budgets): the
        finished batch is scored in the step's own rows and micro-batches, over ``score_group`` (the
        trainer's DP group), so its log-probs stay the trainer's bit for bit."""
        self.score_layout, self.score_group = score_layout, score_group
        self.model, self.dtype, self.params_dtype = model, dtype, params_dtype
        self.max_model_len, self.micro_batch_size, self.pad_id = max_model_len, micro_batch_size, pad_id
        self.eos_ids = _eos_ids(model_dir)
        self.tp_group = ps.get_tensor_model_parallel_group()
        experts_local = ps.get_expert_model_parallel_world_size() * ps.get_expert_tensor_parallel_world_size() == 1
        self.dp_group = ps.get_data_parallel_group() if experts_local else None
        """Completions are sharded over this group (None: every rank runs every row)."""
        self.sync_group = None if experts_local else comm.world_group()
        """Sampled tokens are broadcast from rank 0 over this group each step (expert parallelism)."""
        self._seeds = torch.Generator().manual_seed(seed)
        self.decode_gap_max = 0.0
        """Max |decode - reported log-prob| of this rank's rows in the last ``generate`` (round-off)."""
        logger.info("megatron generator: the trainer's model in %s; completions %s", dtype,
                    "sharded over data parallelism" if comm.group_size(self.dp_group) > 1 else "on every rank")

    # ---- RolloutEngine ------------------------------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling) -> Rollouts:
        _check_sampling(sampling)
        base = sampling.seed if sampling.seed is not None else int(torch.randint(2**31, (1,), generator=self._seeds))
        prompts = [list(p) for p in prompt_token_ids]
        rows = [_Row(prompts[k // n], torch.Generator().manual_seed(base + k))
                for k in range(len(prompts) * n)[self._shard(len(prompts) * n)]]
        # fp8: one quantization, its fp32 dequantization held, for the decode loop (every linear runs per token)
        # and the scoring forward
        with fp8_context(self.model, self.dtype, hold_dequantized=True):
            with self._inference_mode():
                for group in _by_prompt_length(rows):
                    self._decode(group, sampling)
            done = self._gather([(r.tokens, r.finish_reason) for r in rows])
            seqs = [prompts[k // n] + tokens for k, (tokens, _) in enumerate(done)]
            logprobs = self._score_rows(seqs, [len(prompts[k // n]) for k in range(len(done))], sampling.temperature)
        mine = logprobs[self._shard(len(done))]
        self.decode_gap_max = max((abs(a - b) for r, lp in zip(rows, mine) for a, b in zip(r.decode_logprobs, lp)),
                                  default=0.0)
        return Rollouts([Rollout(prompt_index=k // n, prompt_ids=list(prompts[k // n]), completion_ids=tokens,
                                 logprobs=lp, finish_reason=reason, policy_version=self.policy_version)
                         for k, ((tokens, reason), lp) in enumerate(zip(done, logprobs))])

    def submit_generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling) -> Rollouts:
        """Generates now, with the current weights (shared with the trainer): the handle is the result."""
        return self.generate(prompt_token_ids, n, sampling)

    def collect(self, handle: Rollouts) -> Rollouts:
        return handle

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> List[List[float]]:
        """The trainer's forward in the generation dtype at temperature 1 (collective over TP)."""
        return self._score_rows([list(s) for s in sequences], list(prompt_lens), 1.0)

    def update_weights(self, named_tensors: Iterable, version: int) -> List[str]:
        """Records the version; the weights are the trainer's already. Drains ``named_tensors``
        (a push's buckets run collective gathers on every rank), loading nothing."""
        for _ in named_tensors:
            pass
        self.policy_version = version
        return []

    def sleep(self) -> None:
        """Nothing to free between steps: the KV cache lives only during a ``generate`` call."""

    def wake_up(self) -> None:
        """See ``sleep``."""

    def close(self) -> None:
        """Nothing to release: the model is the trainer's."""

    # ---- decoding -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _inference_mode(self):
        """No grad, and eval mode (Megatron uses the KV cache only outside training mode); no sequence
        parallelism (a one-token decode step cannot be split over TP ranks)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), sequence_parallel_disabled(self.model):
                yield
        finally:
            self.model.train(was_training)

    def _decode(self, rows: List[_Row], sampling: Sampling) -> None:
        """KV-cached sampling of ``rows`` (one prompt length) until each stops; fills their tokens."""
        prompt_len = len(rows[0].prompt)
        budget = min(sampling.max_tokens, self.max_model_len - prompt_len)
        stops = set() if sampling.ignore_eos else set(sampling.stop_token_ids) | self.eos_ids
        if budget <= 0:
            for row in rows:
                row.finish_reason = "length"
            return
        context = static_inference_context(len(rows), prompt_len + budget)
        logits = self._forward(torch.tensor([r.prompt for r in rows]), 0, context)
        context.enable_decode_mode()
        active = rows
        for step in range(budget):
            tokens = self._sample(logits, active, sampling.temperature)
            for row, token in zip(active, tokens.tolist()):
                row.tokens.append(token)
                row.finish_reason = "stop" if token in stops else ("length" if step + 1 == budget else None)
            keep = [j for j, row in enumerate(active) if row.finish_reason is None]
            if not keep:
                return
            if len(keep) < len(active):
                keep_kv_rows(context, keep)
                tokens, active = tokens[keep], [active[j] for j in keep]
            logits = self._forward(tokens.unsqueeze(1), prompt_len + step, context)

    def _forward(self, ids: torch.Tensor, start: int, context) -> torch.Tensor:
        """Logits ``[B, V]`` (all of the vocabulary, gathered over TP) of the last of ``ids`` ``[B, s]``
        at positions ``start ...``; advances the KV cache by s."""
        device = model_device(self.model)
        ids = ids.to(device)
        positions = torch.arange(start, start + ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
        with precision_context(self.dtype, self.params_dtype):
            logits = self.model(ids, positions, None, inference_context=context, runtime_gather_output=True)
        context.increment_sequence_len_offset(ids.shape[1])
        return logits[:, -1]

    def _sample(self, logits: torch.Tensor, rows: List[_Row], temperature: float) -> torch.Tensor:
        """One token per row: argmax of softmax(logits / T) / Exp(1) noise from the row's generator."""
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # the temperature after the fp32 cast
        noise = torch.stack([torch.empty(probs.shape[-1]).exponential_(generator=r.generator) for r in rows])
        tokens = (probs / noise.to(probs.device)).argmax(dim=-1)
        if self.sync_group is not None:
            comm.broadcast_tensor(tokens, 0, self.sync_group)
        for row, lp in zip(rows, token_log_probs(logits, tokens, temperature=temperature).tolist()):
            row.decode_logprobs.append(lp)
        return tokens

    # ---- scoring and data parallelism ---------------------------------------------------------------------

    def _score_rows(self, seqs: List[List[int]], prompt_lens: List[int], temperature: float) -> List[List[float]]:
        """Log-probs of ``seqs[i][prompt_lens[i]:]``: this DP rank's rows of the whole batch, packed at
        the whole batch's width (as the trainer packs a step), by the trainer's forward; gathered. In the step's
        layout (``score_layout``) only when the DP size divides the rows, as it does a step's: its token-balanced
        ranks take ``len // dp`` rows each, so the rest (a parity probe's 3 sequences at DP = 2) would get none."""
        if not seqs:
            return []
        if self.score_layout is not None and len(seqs) % comm.group_size(self.score_group) == 0:
            return self._score_as_the_step(seqs, prompt_lens, temperature)
        part = pack(seqs, prompt_lens, self.pad_id).rows(self._shard(len(seqs)))
        scores = []
        if part.input_ids.shape[0]:
            lp = forward_log_probs(self.model, part, compute_dtype=self.dtype, params_dtype=self.params_dtype,
                                   temperature=temperature, tp_group=self.tp_group,
                                   micro_batch_size=self.micro_batch_size)
            scores = completion_scores(lp, part)
        return self._gather(scores)

    def _score_as_the_step(self, seqs: List[List[int]], prompt_lens: List[int], temperature: float):
        """``_score_rows`` in the step's layout (``score_layout``): this DP rank's rows, packed or
        token-budgeted as the trainer will compute them, gathered back into batch order."""
        packed = pack(seqs, prompt_lens, self.pad_id)
        rows, plan = self.score_layout([len(s) for s in seqs], packed)
        part = packed.rows(rows)
        scores = []
        if plan:
            lp = forward_log_probs(self.model, part, compute_dtype=self.dtype, params_dtype=self.params_dtype,
                                   temperature=temperature, tp_group=self.tp_group, plan=plan)
            scores = completion_scores(lp, part)
        index = list(range(len(seqs)))[rows] if isinstance(rows, slice) else rows.tolist()
        out: List[Optional[List[float]]] = [None] * len(seqs)
        for idx, part_scores in comm.all_gather_object((index, scores), self.score_group):
            for i, row in zip(idx, part_scores):
                out[i] = row
        return out

    def _shard(self, total: int) -> slice:
        """This DP rank's contiguous slice of ``total`` rows (all of them without DP sharding)."""
        size, rank = comm.group_size(self.dp_group), comm.group_rank(self.dp_group)
        per = -(-total // size)
        return slice(min(rank * per, total), min((rank + 1) * per, total))

    def _gather(self, items: list) -> list:
        """Every DP rank's ``items`` (its ``_shard`` slice), concatenated in rank order."""
        return [item for part in comm.all_gather_object(items, self.dp_group) for item in part]


def _check_sampling(sampling: Sampling) -> None:
    if sampling.top_p < 1.0 or sampling.top_k > 0:
        raise ValueError("generation.backend=megatron samples from the full distribution: top_p must be 1 and "
                         f"top_k -1 (got top_p={sampling.top_p}, top_k={sampling.top_k})")
    if not sampling.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {sampling.temperature}")


def _by_prompt_length(rows: List[_Row]) -> List[List[_Row]]:
    """Rows grouped by prompt length (one KV-cache offset per batch), in order of first appearance."""
    groups = {}
    for row in rows:
        groups.setdefault(len(row.prompt), []).append(row)
    return list(groups.values())


def _eos_ids(model_dir: str) -> set:
    """``eos_token_id`` of config.json and generation_config.json (vLLM stops at them too)."""
    ids = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return {int(i) for i in ids}
