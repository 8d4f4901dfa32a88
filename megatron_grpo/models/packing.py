"""Micro-batch plans: padded rows, token-budget micro-batches, packed rows.

The loss keeps the step's right-padded ``[b, S]`` tensors (``PackedBatch``); only the model's
input changes. A plan is a list of ``MicroBatch``: the rows the model computes and, per sequence,
where its tokens sit in them, so that per-token log-probs come back as ``[n, S]`` rows of the
padded layout (``MicroBatch.unpack``) and every loss, metric and global token count is the padded
path's.

- **padded** (default): ``micro_batch_size`` sequences per micro-batch, the batch's full width.
- **token budget** (``policy.dynamic_batching``): sequences in length order, each micro-batch
  as many as fit ``rows * width <= max_tokens_per_microbatch``, the width the micro-batch's longest.
- **packed** (``policy.sequence_packing``): sequences placed first-fit-decreasing into rows of up to
  a token budget, one row per micro-batch; positions restart at 0 per sequence and no token attends
  across sequences: on the local spec a block-diagonal causal ``attention_mask`` ``[r, 1, L, L]``
  (bool, True = masked: Megatron's ``attention_mask_func`` fills those scores with -10000, exactly 0
  after the fp32 softmax), built when the row's forward runs (``MicroBatch.model_inputs``); with
  Transformer Engine THD ``PackedSeqParams`` with ``cu_seqlens``. The local spec's RoPE ignores
  ``position_ids`` (it rotates by the row position): ``forward_logits`` makes it rotate each token by its
  ``position_ids`` (``compat.megatron.rotary_positions``), so a sequence gets the padded forward's rotation
  exactly; rotated by its offset o in the row, the fp32 rounding of the angles (o + i) * inv_freq grew
  with o (7.9e-5 in log-probs at o ~ 4k on a tiny model, 1e-2 at 64k).

A sequence needs only its tokens up to its last completion label (``last`` + 1 tokens: the logits at
position t score ``labels[t]``), so padding and the final token are never computed.

MoE: every micro-batch carries Megatron's ``padding_mask`` (True = not one of a sequence's needed
tokens: right padding, a sequence's final token, a packed row's tail, filler rows), so that the routers'
z-loss counts the same tokens in every plan (the step passes it on unless the aux loss is on); MoE routes recorded per micro-batch come back in
the padded layout (``unpack``) and replayed routes go the other way (``to_rows``). Under expert
parallelism the allgather dispatcher needs every rank's micro-batch ``k`` to have one shape:
``build_plan``'s ``shapes`` (agreed over DP by the step) pads rows and widths up to them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams

logger = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """One micro-batch of the model's input and where its sequences' tokens are."""

    index: int
    """position in the plan (fault injection and messages)"""
    seqs: torch.Tensor
    """[n] int64: the sequences (rows of the padded batch) this micro-batch scores"""
    input_ids: torch.Tensor
    """[r, L] int64"""
    labels: torch.Tensor
    """[r, L] int64: the padded batch's labels at the same tokens"""
    gather: Optional[torch.Tensor] = None
    """[n, S] int64 into the flattened ``[r * L]`` log-probs (None: the rows are the padded rows)"""
    valid: Optional[torch.Tensor] = None
    """[n, S] bool: where ``gather`` points at a computed token"""
    position_ids: Optional[torch.Tensor] = None
    """[r, L] int64, restarting at 0 per sequence (packed only)"""
    mask_segments: Optional[Tuple[int, ...]] = None
    """Packed, local spec: the row's segment lengths; ``model_inputs`` builds the block-diagonal causal
    mask ``[1, 1, L, L]`` from them when the micro-batch's forward runs (not held by the plan)"""
    packed_seq_params: Optional[object] = None
    """Megatron's ``PackedSeqParams`` (packed, Transformer Engine: THD)"""
    padding_mask: Optional[torch.Tensor] = None
    """[r, L] bool, Megatron's MoE convention: True = padding, i.e. not a needed token of any sequence"""

    @property
    def num_computed_tokens(self) -> int:
        return self.input_ids.numel()

    def unpack(self, row_values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """``[r, L, ...]`` per-token values -> ``[n, S, ...]`` rows of the padded layout (``fill`` where
        not computed)."""
        if self.gather is None:
            return row_values
        flat = row_values.reshape(-1, *row_values.shape[2:])[self.gather]
        valid = self.valid.view(*self.valid.shape, *[1] * (flat.dim() - 2))
        return torch.where(valid, flat, torch.full_like(flat, fill))

    def to_rows(self, values: torch.Tensor, fill: int = -1) -> torch.Tensor:
        """``[n, S, ...]`` values of this micro-batch's sequences in the padded layout -> ``[r, L, ...]``
        at the tokens the model computes (``fill`` elsewhere): ``unpack``'s inverse."""
        if self.gather is None:
            return values
        rows, width = self.input_ids.shape
        out = values.new_full((rows * width, *values.shape[2:]), fill)
        out[self.gather[self.valid]] = values[self.valid]
        return out.view(rows, width, *values.shape[2:])

    def model_inputs(self) -> dict:
        """Keyword arguments for ``forward_logits`` besides the ids; a packed local-spec row's attention mask
        is built here, per forward, so that a step holds only the masks of the forwards in flight."""
        mask = None if self.mask_segments is None else block_causal_mask(self.mask_segments, self.input_ids.device)
        return {"position_ids": self.position_ids, "attention_mask": mask,
                "packed_seq_params": self.packed_seq_params, "padding_mask": self.padding_mask}


@dataclass(frozen=True)
class PlanSpec:
    """How a step's sequences become micro-batches."""

    micro_batch_size: int = 8
    """sequences per micro-batch (padded mode)"""
    max_tokens: Optional[int] = None
    """token budget per micro-batch (token-budget mode) or per packed row (packed mode)"""
    packing: bool = False
    multiple: int = 8
    """row widths are rounded up to this (8; times TP under sequence parallelism)"""
    fixed_width: bool = False
    """every row the same width (pipeline parallelism: its buffers have one shape)"""
    thd: bool = False
    """packed rows as Transformer Engine THD ``PackedSeqParams`` instead of a mask"""
    count_multiple: int = 1
    """token-budget and packed plans: micro-batches split until their count is a multiple of this (interleaved
    virtual pipeline stages: PP, Megatron's interleaved schedule runs them in groups of PP)"""

    @property
    def balances_tokens(self) -> bool:
        """Token-budget and packed plans: data-parallel ranks get sequences balanced by tokens (equal
        counts; ``balanced_ranks``), so that no rank's rows wait at the gradient all-reduce."""
        return self.packing or self.max_tokens is not None


def needed_lengths(mask: torch.Tensor) -> List[int]:
    """Tokens each sequence needs: up to its last completion label (at least 1)."""
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).amax(dim=1)
    return [max(int(v) + 1, 1) for v in last.tolist()]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def group_by_tokens(lengths: Sequence[int], budget: int, multiple: int) -> List[List[int]]:
    """Token-budget micro-batches: sequences in descending length, each group as many as fit
    ``count * round_up(longest) <= budget`` (at least one)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: List[List[int]] = []
    for i in order:
        if groups:
            width = _round_up(lengths[groups[-1][0]], multiple)
            if (len(groups[-1]) + 1) * width <= budget:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Bins of sequence indices whose lengths sum to at most ``capacity`` (first fit, longest first)."""
    bins: List[List[int]] = []
    loads: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def split_to_count(groups: List[List[int]], count: int) -> List[List[int]]:
    """Splits the groups with the most sequences until there are ``count`` (so that every DP rank
    runs the same number of micro-batches in Megatron's schedule)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        g = max(range(len(groups)), key=lambda k: len(groups[k]))
        if len(groups[g]) < 2:
            raise ValueError(f"cannot split {len(groups)} micro-batches into {count}: too few sequences")
        half = len(groups[g]) // 2
        groups[g:g + 1] = [groups[g][:half], groups[g][half:]]
    return groups


def plan_groups(mask: torch.Tensor, spec: PlanSpec) -> List[List[int]]:
    """The sequence indices of each micro-batch (before any count equalisation)."""
    rows = mask.shape[0]
    if spec.max_tokens is None and not spec.packing:
        return [list(range(i, min(i + spec.micro_batch_size, rows))) for i in range(0, rows, spec.micro_batch_size)]
    lengths = needed_lengths(mask)
    if spec.packing:
        capacity = max(spec.max_tokens or 0, _round_up(max(lengths), spec.multiple))
        groups = [sorted(b) for b in first_fit_decreasing(lengths, capacity)]
    else:
        groups = group_by_tokens(lengths, spec.max_tokens, spec.multiple)
    return split_to_count(groups, _round_up(len(groups), spec.count_multiple))


def build_plan(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, spec: PlanSpec,
               groups: Optional[List[List[int]]] = None,
               shapes: Optional[Sequence[Tuple[int, int]]] = None) -> List[MicroBatch]:
    """The micro-batches of a padded batch ``[b, S]`` (``groups``: from ``plan_groups``, maybe split;
    ``shapes``: per micro-batch ``(rows, width)`` at least ``plan_shapes``', to pad up to; token-budget
    and packed plans only)."""
    groups = plan_groups(mask, spec) if groups is None else groups
    lengths = needed_lengths(mask)
    if spec.max_tokens is None and not spec.packing:
        return [_padded(k, g, lengths, input_ids, labels, spec) for k, g in enumerate(groups)]
    shapes = shapes or plan_shapes(groups, lengths, spec, input_ids.shape[1])
    if spec.packing:
        return [_packed(k, g, lengths, input_ids, labels, spec, shapes[k][1]) for k, g in enumerate(groups)]
    return [_budget(k, g, lengths, input_ids, labels, shapes[k]) for k, g in enumerate(groups)]


def plan_shapes(groups: List[List[int]], lengths: Sequence[int], spec: PlanSpec, full_width: int) -> List[Tuple[int, int]]:
    """``(rows, width)`` of each micro-batch of a token-budget or packed plan."""
    if spec.packing:
        fixed = _round_up(max(max(lengths), spec.max_tokens or 0), spec.multiple) if spec.fixed_width else 0
        return [(1, fixed or _round_up(sum(lengths[i] for i in g), spec.multiple)) for g in groups]
    return [(len(g), min(_round_up(max(lengths[i] for i in g), spec.multiple), full_width)) for g in groups]


def _padded(k, group, lengths, input_ids, labels, spec: PlanSpec) -> MicroBatch:
    seqs = torch.tensor(group, dtype=torch.long, device=input_ids.device)
    ids, lab = input_ids[seqs], labels[seqs]
    extra = spec.micro_batch_size - len(group) if spec.fixed_width else 0
    if extra > 0:  # pipeline parallelism: whole micro-batches (the P2P buffers have one shape)
        ids, lab = torch.cat([ids, ids[:1].expand(extra, -1)]), torch.cat([lab, lab[:1].expand(extra, -1)])
        return _scattered(k, seqs, ids, lab, [(r, 0, input_ids.shape[1]) for r in range(len(group))],
                          input_ids.shape[1], [lengths[i] for i in group])
    pos = torch.arange(ids.shape[1], device=ids.device)
    padding = pos[None, :] >= torch.tensor([lengths[i] for i in group], device=ids.device)[:, None]
    return MicroBatch(k, seqs, ids, lab, padding_mask=padding)


def _budget(k, group, lengths, input_ids, labels, shape: Tuple[int, int]) -> MicroBatch:
    """The group's rows cut to ``shape``'s width; filler rows of token 0 up to its row count."""
    seqs = torch.tensor(group, dtype=torch.long, device=input_ids.device)
    rows, width = shape
    ids = input_ids.new_zeros((rows, width))
    lab = torch.zeros_like(ids)
    cut = min(width, input_ids.shape[1])
    ids[:len(group), :cut], lab[:len(group), :cut] = input_ids[seqs, :cut], labels[seqs, :cut]
    return _scattered(k, seqs, ids, lab, [(r, 0, lengths[i]) for r, i in enumerate(group)], input_ids.shape[1])


def _scattered(k, seqs, ids, lab, places, full_width, needed: Optional[Sequence[int]] = None) -> MicroBatch:
    """``places``: per sequence ``(row, offset, length)`` in ``ids``; ``needed``: per sequence the tokens
    that are not padding, when fewer than ``length`` (default ``length``)."""
    width = ids.shape[1]
    pos = torch.arange(full_width, device=ids.device)
    gather = torch.zeros((len(places), full_width), dtype=torch.long, device=ids.device)
    valid = torch.zeros((len(places), full_width), dtype=torch.bool, device=ids.device)
    padding = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    for j, (row, offset, length) in enumerate(places):
        gather[j, :length] = row * width + offset + pos[:length]
        valid[j, :length] = True
        n = length if needed is None else needed[j]
        padding[row, offset:offset + n] = False
    return MicroBatch(k, seqs, ids, lab, gather, valid, padding_mask=padding)


def _packed(k, group, lengths, input_ids, labels, spec: PlanSpec, width: int) -> MicroBatch:
    """One row holding ``group``'s sequences back to back; the row's end padded to ``width``."""
    seqs = torch.tensor(group, dtype=torch.long, device=input_ids.device)
    used = sum(lengths[i] for i in group)
    ids = torch.zeros((1, width), dtype=torch.long, device=input_ids.device)
    lab = torch.zeros_like(ids)
    positions = torch.zeros_like(ids)
    places, offset, seqlens = [], 0, []
    for i in group:
        n = lengths[i]
        ids[0, offset:offset + n], lab[0, offset:offset + n] = input_ids[i, :n], labels[i, :n]
        positions[0, offset:offset + n] = torch.arange(n, device=ids.device)
        places.append((0, offset, n))
        seqlens.append(n)
        offset += n
    if width > used:  # the row's tail: its own segment (positions from 0, attending only to itself)
        positions[0, used:] = torch.arange(width - used, device=ids.device)
        seqlens.append(width - used)
    mb = _scattered(k, seqs, ids, lab, places, input_ids.shape[1])
    mb.position_ids = positions
    if spec.thd:
        mb.packed_seq_params = thd_params(seqlens, ids.device)
    else:
        mb.mask_segments = tuple(seqlens)
    return mb


def block_causal_mask(seqlens: Sequence[int], device=None) -> torch.Tensor:
    """``[1, 1, L, L]`` bool, True = masked: token i sees token j only in its own segment and j <= i.
    Built in place: L^2 bytes, no L^2 temporaries."""
    total = sum(seqlens)
    masked = torch.ones((total, total), dtype=torch.bool, device=device)
    start = 0
    for n in seqlens:
        masked[start:start + n, start:start + n].triu_(1)  # within the segment only the future is masked
        start += n
    return masked[None, None]


def cu_seqlens(seqlens: Sequence[int], device=None) -> torch.Tensor:
    """``[len + 1]`` int32 cumulative lengths starting at 0 (THD's boundaries)."""
    return torch.cumsum(torch.tensor([0, *seqlens], dtype=torch.int32, device=device), 0, dtype=torch.int32)


def thd_params(seqlens: Sequence[int], device=None):
    """Megatron's ``PackedSeqParams`` for one packed row (Transformer Engine's THD attention)."""
    cu = cu_seqlens(seqlens, device)
    longest = max(seqlens)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def attention_scores(shapes: Iterable[Tuple[int, int]]) -> int:
    """Attention scores (per head and layer) that micro-batches of ``(rows, width)`` compute on the local spec:
    each row attends over its whole width, ``rows * width ** 2`` (a packed row's block-diagonal mask removes
    none of them; THD attention computes ``sum(n ** 2)`` over a row's sequences). Pure: the memory plan's s^2."""
    return sum(rows * width * width for rows, width in shapes)


def log_packing_cost(plan: Sequence[MicroBatch], padded_shape: Tuple[int, int]) -> bool:
    """Logs a line when the packed rows of ``plan`` (local spec) compute more attention scores than the
    padded micro-batches of the same ``[b, S]`` batch would (``b * S^2``); returns whether it did."""
    packed = attention_scores(tuple(mb.input_ids.shape) for mb in plan if mb.mask_segments is not None)
    padded = attention_scores([tuple(padded_shape)])
    if packed <= padded:
        return False
    per_sequence = attention_scores((1, n) for mb in plan for n in (mb.mask_segments or ()))
    logger.warning("policy.sequence_packing on the local spec computes %.3gM attention scores per head and layer "
                   "for these %d sequences, %.1fx the %.3gM of padded micro-batches (%.3gM per sequence): each "
                   "packed row attends over its whole length (Transformer Engine's THD attention does not); "
                   "shorter rows (policy.sequence_packing.train_mb_tokens) cost less", packed / 1e6, padded_shape[0],
                   packed / padded, padded / 1e6, per_sequence / 1e6)
    return True


def computed_tokens(plan: Sequence[MicroBatch]) -> int:
    """Tokens the model computes for a plan (padding included)."""
    return sum(mb.num_computed_tokens for mb in plan)


def step_rows(lengths: Sequence[int], dp_rank: int, dp_size: int, balance_tokens: bool = False):
    """This DP rank's sequences of a step (``lengths``: each one's tokens): a contiguous slice, or with
    ``balance_tokens`` (``PlanSpec.balances_tokens``) the indices ``balanced_ranks`` gives it."""
    if balance_tokens and dp_size > 1:
        return torch.tensor(balanced_ranks(lengths, dp_size)[dp_rank], dtype=torch.long)
    rows = len(lengths) // dp_size
    return slice(dp_rank * rows, (dp_rank + 1) * rows)


def balanced_ranks(lengths: Sequence[int], dp_size: int) -> List[List[int]]:
    """Sequence indices per DP rank: equal counts, tokens balanced greedily (longest first to the
    least-loaded rank that still has room), each rank's indices in order."""
    per_rank = len(lengths) // dp_size
    ranks: List[List[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(range(per_rank * dp_size), key=lambda i: -lengths[i]):
        r = min((r for r in range(dp_size) if len(ranks[r]) < per_rank), key=lambda r: loads[r])
        ranks[r].append(i)
        loads[r] += lengths[i]
    return [sorted(r) for r in ranks]
