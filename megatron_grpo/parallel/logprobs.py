"""Per-token log-probabilities from (vocab-parallel) logits, chunked, in fp32.

Shaped like Megatron-Core's ``tensor_parallel/cross_entropy.py``: static step
functions, a thin ``autograd.Function`` with three all-reduces over the tensor-parallel
group (max, sum of exp, target logit), and a documented public wrapper. Differences:
it returns log-probs (not a loss), it never modifies the input logits, and it never
holds fp32 logits for more than ``chunk_size`` tokens at once, in forward or backward
(the softmax is recomputed chunk by chunk in backward from the saved fp32 log-sum-exp).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from megatron_grpo.parallel import comm

DEFAULT_CHUNK_SIZE = 512
"""Tokens per fp32 chunk when ``chunk_size`` is None: 512 x 151,936 x 4 B = 0.3 GB."""


def _shard_range(vocab_local: int, tp_group) -> Tuple[int, int]:
    """Vocabulary ids ``[start, end)`` held by this rank (Megatron's contiguous split)."""
    start = comm.group_rank(tp_group) * vocab_local
    return start, start + vocab_local


def _scaled_fp32(logits_chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh fp32 copy of the chunk divided by the temperature *after* the cast (vLLM does the
    same): dividing bf16 logits first rounds them again (T = 0.7: mean |d logp| 0.045)."""
    x = logits_chunk.to(torch.float32, copy=True)  # a copy even for fp32 input: modified in place later
    if temperature != 1.0:
        x.div_(temperature)
    return x


def _chunk_stats(logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, start: int, tp_group, want_entropy: bool,
                 temperature: float = 1.0):
    """Forward of one chunk: returns (target_logit - lse, lse, entropy or None), all fp32 ``[c]``,
    of ``softmax(logits / temperature)``.

    Holds one fp32 copy of the chunk (two with ``want_entropy``): shifted logits are
    exponentiated in place after the target logit has been read.
    """
    x = _scaled_fp32(logits_chunk, temperature)
    global_max = comm.all_reduce_max(x.max(dim=-1).values, tp_group)
    x.sub_(global_max.unsqueeze(-1))
    local_ids = labels_chunk - start
    in_shard = (local_ids >= 0) & (local_ids < x.shape[-1])
    picked = x.gather(-1, local_ids.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target = comm.all_reduce_sum(torch.where(in_shard, picked, torch.zeros_like(picked)), tp_group)
    p_x = (x.exp() * x).sum(dim=-1) if want_entropy else None
    sum_exp = comm.all_reduce_sum(x.exp_().sum(dim=-1), tp_group)
    log_z = sum_exp.log()
    entropy = None
    if want_entropy:
        # H = log Z - sum_v p_v * x_v  (x shifted by the max)
        entropy = log_z - comm.all_reduce_sum(p_x, tp_group) / sum_exp
    return target - log_z, log_z + global_max, entropy


def _chunk_grad(logits_chunk, labels_chunk, lse_chunk, grad_chunk, start: int, temperature: float = 1.0) -> torch.Tensor:
    """Backward of one chunk: d logp / d logits = (onehot(label) - softmax) / T, times the incoming grad."""
    probs = _scaled_fp32(logits_chunk, temperature).sub_(lse_chunk.unsqueeze(-1)).exp_()
    grad_chunk = grad_chunk / temperature
    grad = probs.mul_(-grad_chunk.unsqueeze(-1))
    local_ids = labels_chunk - start
    in_shard = (local_ids >= 0) & (local_ids < grad.shape[-1])
    rows = torch.nonzero(in_shard, as_tuple=True)[0]
    grad[rows, local_ids[rows]] += grad_chunk[rows]
    return grad.to(logits_chunk.dtype)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp_group, chunk_size, want_entropy, temperature):
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1)
        start, _ = _shard_range(flat_logits.shape[-1], tp_group)
        n = flat_logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if want_entropy else None
        for i in range(0, n, chunk_size):
            sl = slice(i, min(i + chunk_size, n))
            lp, ls, ent = _chunk_stats(flat_logits[sl], flat_labels[sl], start, tp_group, want_entropy, temperature)
            logp[sl], lse[sl] = lp, ls
            if want_entropy:
                entropy[sl] = ent
        ctx.save_for_backward(logits, labels, lse)
        ctx.tp_group, ctx.chunk_size, ctx.start, ctx.temperature = tp_group, chunk_size, start, temperature
        out_shape = labels.shape
        if want_entropy:
            ctx.mark_non_differentiable(entropy)
            return logp.view(out_shape), entropy.view(out_shape)
        return logp.view(out_shape)

    @staticmethod
    def backward(ctx, grad_logp, *unused):
        logits, labels, lse = ctx.saved_tensors
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1)
        flat_grad = grad_logp.reshape(-1).float()
        grad_logits = torch.empty_like(flat_logits)
        n = flat_logits.shape[0]
        for i in range(0, n, ctx.chunk_size):
            sl = slice(i, min(i + ctx.chunk_size, n))
            grad_logits[sl] = _chunk_grad(flat_logits[sl], flat_labels[sl], lse[sl], flat_grad[sl], ctx.start,
                                          ctx.temperature)
        return grad_logits.view_as(logits), None, None, None, None, None


def token_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group=None,
    chunk_size: Optional[int] = None,
    return_entropy: bool = False,
    temperature: float = 1.0,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """fp32 log-probabilities of ``labels`` under ``softmax(logits / temperature)``, vocab-parallel
    and chunked; the temperature divides the fp32 copy of each chunk, never the input logits.

    Args:
        logits: ``[..., V/tp]``, this rank's contiguous vocabulary shard (rank r holds ids
            ``[r*V/tp, (r+1)*V/tp)``), any float dtype; never modified.
        labels: ``[...]`` int64 global token ids.
        tp_group: tensor-parallel process group; None = single-process computation.
        chunk_size: tokens per fp32 chunk (default ``DEFAULT_CHUNK_SIZE``).
        return_entropy: also return the per-token entropy ``[...]`` (fp32, no gradient).
        temperature: sampling temperature T > 0 (the generator's).

    Returns:
        ``[...]`` fp32 log-probs, differentiable w.r.t. ``logits`` (and the entropy).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits shape {tuple(logits.shape)}[:-1]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    chunk = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
    if chunk <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelLogProbs.apply(logits, labels.long(), tp_group, chunk, return_entropy, float(temperature))
