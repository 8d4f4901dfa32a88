"""Whole-model sums over DDP's reduced gradients (``param.main_grad``), for diagnostics.

Megatron's DDP and ``finalize_model_grads`` reduce the gradients and its optimizer computes the
grad norm; this module only adds what Megatron has no function for: the cosine between the
actual gradient and another one (``grad/cos_clean``). Tensor-parallel duplicates are counted
once, as is a tied embedding under pipeline parallelism (the last stage's output-layer copy is
tagged ``shared``: Megatron's ``param_is_not_shared``), and shards summed over the model-parallel
ranks (experts over the expert model-parallel ranks). It needs the full reduced gradient on every rank (not the distributed optimizer's
reduce-scattered shards; the config refuses that combination).
"""

from __future__ import annotations

from typing import List

import torch
from megatron.core import parallel_state as ps

from megatron_grpo.parallel import comm


def _is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def model_sum(params: List[torch.nn.Parameter], per_param) -> torch.Tensor:
    """Sum of ``per_param(i, p)`` over the whole model (float64)."""
    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    device = params[0].device if params else None
    dense, expert = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
    for i, p in enumerate(params):
        if getattr(p, "shared", False):  # the last stage's copy of the tied embedding: counted on the first
            continue
        if not getattr(p, "tensor_model_parallel", False) and (etp_rank if _is_expert(p) else tp_rank) != 0:
            continue
        value = per_param(i, p).double()
        if _is_expert(p):
            expert += value
        else:
            dense += value
    comm.all_reduce_sum(dense, ps.get_model_parallel_group())
    comm.all_reduce_sum(expert, ps.get_expert_tensor_model_pipeline_parallel_group())
    return dense + expert


def gradient_cosine(params: List[torch.nn.Parameter], other: List[torch.Tensor]) -> torch.Tensor:
    """Cosine between the current ``main_grad`` and ``other`` (same order), over the whole model."""
    dot = model_sum(params, lambda i, p: (p.main_grad.double() * other[i].double()).sum())
    own = model_sum(params, lambda i, p: p.main_grad.double().pow(2).sum())
    theirs = model_sum(params, lambda i, p: other[i].double().pow(2).sum())
    return (dot / (own.sqrt() * theirs.sqrt()).clamp(min=1e-30)).float()
