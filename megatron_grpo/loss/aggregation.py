"""Loss aggregation modes (verl's ``agg_loss``), normalised by *global* counts.

Each returns this rank's/micro-batch's share: summing the results over micro-batches
and data-parallel ranks gives the exact global value.
"""

from __future__ import annotations

import torch

from megatron_grpo.registry import Registry

AGGREGATIONS = Registry("aggregation")


@AGGREGATIONS.register("token_mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, num_global_tokens, num_global_seqs) -> torch.Tensor:
    """sum over valid tokens / global valid-token count."""
    return (per_token * mask).sum() / num_global_tokens


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, num_global_tokens, num_global_seqs) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean."""
    maskf = mask.float()
    per_seq = (per_token * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)
    return per_seq.sum() / num_global_seqs


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, num_global_tokens, num_global_seqs) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum (Dr. GRPO style)."""
    return (per_token * mask).sum() / num_global_seqs
