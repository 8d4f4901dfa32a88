"""Gradient reductions across data-parallel ranks and the TP/EP-aware global grad norm.

Losses are normalised by the *global* token count, so DP gradients are summed (not
averaged). Expert parameters (``param.allreduce == False``) are summed over the
expert-data-parallel group, the rest over the data-parallel group; one flat
all-reduce per group.
"""

from __future__ import annotations

from typing import Iterable, List

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_grpo.parallel import comm


def tag_expert_params(named_params: Iterable) -> None:
    """Marks MoE expert parameters. Megatron sets ``allreduce = False`` on them only when
    EP > 1; with EP = 1 and expert-TP > 1 they are still ETP shards, reduced over expert-DP."""
    for name, param in named_params:
        if ".experts." in name:
            param.megatron_grpo_expert = True


def _is_expert(param) -> bool:
    return getattr(param, "megatron_grpo_expert", False) or not getattr(param, "allreduce", True)


def _sum_flat(grads: List[torch.Tensor], group) -> None:
    if not grads or comm.group_size(group) == 1:
        return
    flat = comm.all_reduce_sum(_flatten_dense_tensors(grads), group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def _tp_partial(name: str, param) -> bool:
    """Replicated params whose gradient each TP rank sees only in part: QK-norm weights are
    shared by all heads but each rank normalises only its own heads (Megatron sums these
    over TP in ``finalize_model_grads``), and sequence-parallel norms."""
    return "q_layernorm" in name or "k_layernorm" in name or getattr(param, "sequence_parallel", False)


def all_reduce_gradients(named_params: Iterable) -> None:
    """Sums partial TP grads over TP, then ``.grad`` over data-parallel ranks (experts: expert-DP)."""
    from megatron.core import parallel_state as ps

    named = [(n, p) for n, p in named_params if p.grad is not None]
    _sum_flat([p.grad for n, p in named if _tp_partial(n, p)], ps.get_tensor_model_parallel_group())
    params = [p for _, p in named]
    _sum_flat([p.grad for p in params if not _is_expert(p)], ps.get_data_parallel_group())
    _sum_flat([p.grad for p in params if _is_expert(p)], ps.get_expert_data_parallel_group())


def model_sum(params: List[torch.nn.Parameter], per_param) -> torch.Tensor:
    """Sum of ``per_param(i, p)`` over the whole model: TP duplicates counted once, shards summed
    over the model-parallel ranks (experts over the expert model-parallel ranks)."""
    from megatron.core import parallel_state as ps

    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    device = params[0].device if params else None
    dense, expert = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
    for i, p in enumerate(params):
        if p.grad is None:
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


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of the full model's gradient (TP duplicates counted once, shards summed)."""
    params = list(params)
    return model_sum(params, lambda i, p: p.grad.double().pow(2).sum()).sqrt()


def gradient_cosine(params: List[torch.nn.Parameter], other: List[torch.Tensor]) -> torch.Tensor:
    """Cosine between the current ``.grad`` and ``other`` (same order), over the whole model."""
    dot = model_sum(params, lambda i, p: (p.grad.double() * other[i].double()).sum())
    own = model_sum(params, lambda i, p: p.grad.double().pow(2).sum())
    theirs = model_sum(params, lambda i, p: other[i].double().pow(2).sum())
    return (dot / (own.sqrt() * theirs.sqrt()).clamp(min=1e-30)).float()


def clip_gradients(params: List[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scales gradients so their global norm is at most ``max_norm`` (no host sync)."""
    if max_norm <= 0:
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
