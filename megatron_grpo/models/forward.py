"""Trainer-side forwards: packing completions, precision contexts, per-token log-probs.

Sequences are right-padded (prompt + completion + pad), so causal attention needs no
mask: padding only follows valid tokens. The model may see them otherwise (packed rows,
token-budget micro-batches: ``models/packing.py``); log-probs come back in the padded layout.
Log-probs come from the vocab-parallel, chunked ``token_log_probs`` and are fp32.

Precisions are torch dtypes; ``torch.float8_e4m3fn`` (``config.precision.to_dtype("fp8")``) stands for the FP8
precision of the generator and the shadow: bf16 autocast around the FP8 linears of ``models/fp8.py``
(``precision_context`` + ``fp8_context``), with the recipe the model was built with (``fp8.attach_recipe``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_grpo.compat.megatron import stage_output_dtype
from megatron_grpo.models import forward_logits, model_chunks, unwrap
from megatron_grpo.models.fp8 import FP8_DTYPE, OUTPUT_DTYPE, QuantizedWeight, fp8_forward, recipe_of
from megatron_grpo.models.packing import MicroBatch, PlanSpec, build_plan
from megatron_grpo.parallel import comm
from megatron_grpo.parallel.logprobs import token_log_probs


@dataclass
class PackedBatch:
    """Right-padded token batch; position t of ``labels``/``mask`` scores token t+1."""

    input_ids: torch.Tensor
    """[B, S] int64"""
    labels: torch.Tensor
    """[B, S] int64: input_ids shifted left by one (last column padding)"""
    mask: torch.Tensor
    """[B, S] bool: True where labels[t] is a completion token"""

    def rows(self, sl: slice) -> "PackedBatch":
        return PackedBatch(self.input_ids[sl], self.labels[sl], self.mask[sl])

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device), self.labels.to(device), self.mask.to(device))


def model_device(model) -> torch.device:
    """Where the model's parameters live (a model, or a list of model chunks)."""
    return next(model_chunks(model)[0].parameters()).device


def plan_iterators(plan: Sequence[MicroBatch], model):
    """The data iterator Megatron's schedule takes for ``model``: one over ``plan``; for a list of model chunks
    (interleaved virtual stages) one per chunk, each over the whole plan (every chunk's forward step reads its
    micro-batch: the first chunk its ids, the last its labels, the others the shapes they pass on)."""
    chunks = model_chunks(model)
    return [iter(plan) for _ in chunks] if isinstance(model, (list, tuple)) else iter(plan)


def pack(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], pad_id: int = 0,
         pad_to_multiple: int = 8) -> PackedBatch:
    """Packs prompt+completion id lists into a right-padded batch with a completion-token mask."""
    longest = max(len(s) for s in sequences)
    width = -(-longest // pad_to_multiple) * pad_to_multiple
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, p - 1 : len(seq) - 1] = True
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad_id)], dim=1)
    return PackedBatch(ids, labels, mask)


def around_dtype(precision: torch.dtype) -> torch.dtype:
    """The dtype a precision's forward runs in outside its GEMMs: bf16 for fp8 (FP8 GEMMs write bf16, and
    vLLM runs the rest of an fp8 model in bf16), else the precision itself."""
    return OUTPUT_DTYPE if precision == FP8_DTYPE else precision


def precision_context(compute_dtype: torch.dtype, params_dtype: torch.dtype):
    """Autocast to ``compute_dtype`` when it is lower than the params' dtype, else nothing; fp8: autocast
    to bf16 (the FP8 linears themselves: ``fp8_context``)."""
    compute_dtype = around_dtype(compute_dtype)
    if compute_dtype == params_dtype or compute_dtype == torch.float32:
        return contextlib.nullcontext()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device, dtype=compute_dtype)


@contextlib.contextmanager
def fp8_context(model, precision: torch.dtype, weights: Optional[Dict[str, QuantizedWeight]] = None,
                hold_dequantized: bool = False) -> Iterator[Optional[Dict[str, QuantizedWeight]]]:
    """With the fp8 precision, ``model``'s FP8 linears compute the emulated FP8 GEMM (``fp8.fp8_forward``)
    with the model's recipe on ``weights`` (default: this rank's weights, quantized once on entry), and the
    block yields those quantized weights; other precisions: nothing (yields None). Re-entrant: inside an
    active fp8 context of the same model, the outer one's bytes are used (the megatron generator quantizes
    once per ``generate``: its decode loop and its scoring forward run on the same bytes; ``hold_dequantized``:
    ``fp8.fp8_forward``'s)."""
    gpt = unwrap(model)
    active = getattr(gpt, "fp8_weights_in_use", None)
    assert active is None or precision == FP8_DTYPE, f"a {precision} forward inside an fp8 forward of the model"
    if precision != FP8_DTYPE or active is not None:
        yield active
        return
    with fp8_forward(gpt, recipe_of(gpt), weights, hold_dequantized) as quantized:
        gpt.fp8_weights_in_use = quantized
        try:
            yield quantized
        finally:
            gpt.fp8_weights_in_use = None


@contextlib.contextmanager
def pipeline_dtype(model, compute_dtype: torch.dtype, params_dtype: torch.dtype):
    """Sets the dtype of the activations (and their gradients) the pipeline stages exchange to what
    a stage outputs under ``precision_context`` (the receiving stage allocates its buffer in
    ``config.pipeline_dtype``): the dtype of a stage's last residual add, which depends on
    Megatron-Core's version under autocast (``compat.megatron.stage_output_dtype``); fp8 as bf16 (its
    linears write bf16)."""
    config = unwrap(model_chunks(model)[0]).config  # one config object, shared by every chunk
    output = stage_output_dtype(around_dtype(compute_dtype), params_dtype)
    previous, config.pipeline_dtype = config.pipeline_dtype, output
    try:
        yield
    finally:
        config.pipeline_dtype = previous


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float, tp_group=None,
                          chunk_size=None) -> torch.Tensor:
    """fp32 log-probs of ``labels`` under ``softmax(logits / temperature)``; ``logits`` [B, S, V/tp]
    in any dtype (the temperature is applied after the cast to fp32, inside ``token_log_probs``)."""
    return token_log_probs(logits, labels, tp_group=tp_group, chunk_size=chunk_size, temperature=temperature)


def forward_log_probs(model, batch: PackedBatch, *, compute_dtype: torch.dtype, params_dtype: torch.dtype,
                      temperature: float = 1.0, tp_group=None, micro_batch_size: int = 8,
                      plan: Optional[List[MicroBatch]] = None) -> torch.Tensor:
    """No-grad log-probs ``[B, S]`` of ``batch.labels`` at the model's current weights in
    ``compute_dtype`` (fp8: quantized once for the whole pass, ``fp8_context``), through Megatron's
    forward-only schedule (pipeline stages pass activations; the last stage computes the log-probs and
    every stage gets them). ``plan``: the micro-batches
    (``models/packing.py``: padded, token-budget or packed rows); default ``micro_batch_size`` padded
    rows, with PP > 1 padded to whole micro-batches (the P2P buffers have one shape); with model chunks
    (interleaved virtual stages) the last micro-batch repeated up to a multiple of PP."""
    device = model_device(model)
    batch = batch.to(device)
    pp = comm.group_size(comm.pipeline_group())
    if plan is None:
        spec = PlanSpec(micro_batch_size=micro_batch_size, fixed_width=pp > 1)
        plan = build_plan(batch.input_ids, batch.labels, batch.mask, spec)
    if isinstance(model, (list, tuple)) and len(plan) % pp:  # the interleaved schedule: groups of PP micro-batches
        plan = list(plan) + [plan[-1]] * (pp - len(plan) % pp)  # a repeat writes the same log-probs again
    out = torch.zeros(batch.labels.shape, dtype=torch.float32, device=device)
    got = []

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        with precision_context(compute_dtype, params_dtype):
            logits = forward_logits(chunk, mb.input_ids, **mb.model_inputs())

        def collect(output):
            out[mb.seqs] = mb.unpack(log_probs_from_logits(output, mb.labels, temperature, tp_group))
            got.append(True)
            return torch.zeros((), device=device), torch.ones((), dtype=torch.int, device=device), {}

        return logits, collect

    rows, width = plan[0].input_ids.shape
    with torch.no_grad(), pipeline_dtype(model, compute_dtype, params_dtype), contextlib.ExitStack() as fp8:
        for chunk in model_chunks(model):
            fp8.enter_context(fp8_context(chunk, compute_dtype))
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=plan_iterators(plan, model), model=model,
            num_microbatches=len(plan),
            seq_length=width, micro_batch_size=rows, forward_only=True)
    return comm.tensor_from_last_stage(out if got else None, batch.labels.shape, torch.float32, device)


def completion_scores(lp: torch.Tensor, batch: PackedBatch) -> List[List[float]]:
    """Per-sequence lists of the masked (completion) log-probs."""
    return [row[m].tolist() for row, m in zip(lp, batch.mask)]
