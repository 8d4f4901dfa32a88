"""Metric statistics that add up across micro-batches and data-parallel ranks.

A metric such as ``precision/beta_std`` is not additive, but the sums it is made of
(count, sum of beta, sum of beta^2) are. ``StatSet`` keeps those sums (float64, on
device) and running maxima; ``reduce`` does one SUM and one MAX all-reduce over the
data-parallel group, after which ``megatron_grpo.loss.metrics.finalize`` turns them
into the named metrics. No host sync happens here.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_grpo.parallel import comm


class StatSet:
    """Additive sums and maxima keyed by name."""

    def __init__(self):
        self.sums: Dict[str, torch.Tensor] = {}
        self.maxes: Dict[str, torch.Tensor] = {}

    def add_sum(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64).reshape(())
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def add_max(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64).reshape(())
        self.maxes[name] = torch.maximum(self.maxes[name], value) if name in self.maxes else value

    def merge(self, other: "StatSet") -> "StatSet":
        """Adds ``other``'s sums and maxima into this set; returns self."""
        for name, value in other.sums.items():
            self.add_sum(name, value)
        for name, value in other.maxes.items():
            self.add_max(name, value)
        return self

    def discard(self, *names: str) -> "StatSet":
        """Drops the sums and maxima named ``names`` (absent ones are ignored); returns self."""
        for name in names:
            self.sums.pop(name, None)
            self.maxes.pop(name, None)
        return self

    def from_last_stage(self, device: torch.device) -> "StatSet":
        """The last pipeline stage's sums and maxima on every stage, on ``device`` (PP = 1: self)."""
        packed = {**{f"sum:{k}": v for k, v in self.sums.items()}, **{f"max:{k}": v for k, v in self.maxes.items()}}
        got = comm.scalars_from_last_stage(packed, device)
        if got is packed:
            return self
        out = StatSet()
        out.sums = {k[4:]: v for k, v in got.items() if k.startswith("sum:")}
        out.maxes = {k[4:]: v for k, v in got.items() if k.startswith("max:")}
        return out

    def reduce(self, group=None) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """Global sums and maxima over ``group`` (one SUM and one MAX collective)."""
        return _reduce(self.sums, comm.all_reduce_sum, group), _reduce(self.maxes, comm.all_reduce_max, group)


def _reduce(values: Dict[str, torch.Tensor], op, group) -> Dict[str, torch.Tensor]:
    if not values:
        return {}
    names = sorted(values)
    packed = op(torch.stack([values[n] for n in names]), group)
    return dict(zip(names, packed.unbind(0)))


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over valid tokens, in float64."""
    return torch.where(mask, x.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device)).sum()


def masked_max(x: torch.Tensor, mask: torch.Tensor, default: Optional[float] = 0.0) -> torch.Tensor:
    """Max of ``x`` over valid tokens (``default`` when none)."""
    fill = torch.full((), float("-inf"), dtype=torch.float64, device=x.device)
    out = torch.where(mask, x.to(torch.float64), fill).max() if x.numel() else fill
    return torch.where(torch.isinf(out), torch.full_like(out, default), out)
