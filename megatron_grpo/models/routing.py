"""MoE routing: router precision, recording, comparing and replaying top-k expert choices.

Megatron-Core's ``TopKRouter`` asks its ``router_replay`` object for the top-k experts of
each token (``topk_routing_with_score_function``). ``RouteTap`` is such an object, one per
router (Megatron's own ``RouterReplay`` keeps a process-global list of instances; ours
belong to one model). A tap always computes the router's natural top-k; it records it,
and in replay mode returns target indices instead (R2: the shadow forward's routing;
R3: the routing vLLM returned). A target row of -1 keeps the natural choice.

``Routing`` also sets each router's gate precision per forward: the trainer's forward
uses ``moe_router_dtype`` (fp32/fp64, autocast off), the shadow forward the generator's
router precision (vLLM's Qwen3-MoE gate is a plain linear layer in the model dtype).

Routes are int16 tensors ``[B, S, L, k]`` (batch, position, this stage's MoE layers, top-k), in the
padded layout whatever the micro-batch plan (``models/packing.py``): given the plan, ``Routing.forward``
lays replayed routes out per micro-batch as the model computes them (packed rows, token-budget rows;
positions no sequence needs get -1: natural) and ``take`` scatters the records back (-1 at positions
the plan does not compute).

Sequence parallelism: each TP rank's routers see only its shard of the sequence (positions
``[r S/tp, (r+1) S/tp)`` of every row, S padded to a multiple of TP as ``forward_logits`` pads
it). ``take`` all-gathers the shards over TP, so every TP rank holds the record of every
position, in order (routing metrics, reduced over DP only, count each position once); replay
hands each rank's taps only its shard of the targets.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_grpo.compat.megatron import set_router_replay
from megatron_grpo.models.qwen3 import sequence_multiple, unwrap
from megatron_grpo.parallel import comm

ROUTE_DTYPE = torch.int16


class RouteTap:
    """The ``router_replay`` hook of one router: natural top-k, optional replay, records."""

    def __init__(self):
        self.recording = False
        self.replay = False
        self.targets: deque = deque()
        self.natural: List[torch.Tensor] = []
        self.used: List[torch.Tensor] = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Megatron's hook: returns ``(top-k scores, top-k indices)`` of ``scores`` [tokens, experts]."""
        values, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if not self.recording:
            return values, natural
        used = natural
        if self.replay:
            if not self.targets:
                raise RuntimeError("routing replay: no recorded routing left for this forward")
            target = self.targets.popleft().to(device=scores.device, dtype=torch.long)
            if target.shape != natural.shape:
                raise ValueError(f"routing replay: target routing {tuple(target.shape)} does not match this "
                                 f"forward's {tuple(natural.shape)} (tokens x top-k)")
            used = torch.where((target < 0).any(-1, keepdim=True), natural, target)
            values = scores.gather(1, used)
        self.natural.append(natural.detach().to(ROUTE_DTYPE))
        self.used.append(used.detach().to(ROUTE_DTYPE))
        return values, used

    def clear(self) -> None:
        self.targets.clear()
        self.natural, self.used = [], []


def _gating(router, control: "Routing", input: torch.Tensor) -> torch.Tensor:
    """The router gate in ``control.router_dtype`` (autocast off, so the dtype is honoured)."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    dtype = control.router_dtype
    bias = None if router.bias is None else router.bias.to(dtype)
    with torch.autocast(input.device.type, enabled=False):
        return router_gating_linear(input.to(dtype), router.weight.to(dtype), bias, dtype)


class Routing:
    """Router precision and route taps of one model's MoE layers (this pipeline stage)."""

    def __init__(self, model, train_dtype: torch.dtype, shadow_dtype: torch.dtype):
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("routing: the model has no MoE routers")
        self.routers = sorted(routers, key=lambda r: r.layer_number or 0)
        self.layer_numbers = [int(r.layer_number) for r in self.routers]
        """1-based global layer numbers of this stage's MoE layers."""
        self.config = unwrap(model).config
        self.train_dtype, self.shadow_dtype = train_dtype, shadow_dtype
        self.router_dtype = train_dtype
        self.taps = [RouteTap() for _ in self.routers]
        self.plan: Optional[Sequence] = None
        """The micro-batches (``MicroBatch``) of the forwards being recorded (None: whole padded rows)."""
        for router, tap in zip(self.routers, self.taps):
            set_router_replay(router, tap)
            router.gating = functools.partial(_gating, router, self)

    @contextlib.contextmanager
    def forward(self, shadow: bool = False, targets: Optional[torch.Tensor] = None, plan: Optional[Sequence] = None):
        """Records the routing of the enclosed forwards (read it with ``take``), in the shadow's
        or the trainer's router precision; ``plan``: the micro-batches those forwards run, in order
        (None: whole padded rows); with ``targets`` ``[B, S, L, k]`` (-1 rows: natural), replays them
        over the plan's micro-batches."""
        for tap in self.taps:
            tap.clear()
            tap.recording, tap.replay = True, targets is not None
        self.plan = plan
        if targets is not None:
            if plan is None:
                raise ValueError("routing replay: the forwards' micro-batch plan is needed to lay out the targets")
            self._queue(targets, plan)
        self.router_dtype = self.shadow_dtype if shadow else self.train_dtype
        try:
            yield self
        finally:
            self.router_dtype = self.train_dtype
            for tap in self.taps:
                tap.recording = tap.replay = False
                tap.targets.clear()

    def _sequence_shards(self) -> Tuple[Optional[object], int, int]:
        """(TP group, TP size, TP rank) when the forwards split the sequence over TP, else (None, 1, 0)."""
        from megatron.core import parallel_state as ps

        tp = sequence_multiple(self.config)
        if tp == 1:
            return None, 1, 0
        return ps.get_tensor_model_parallel_group(), tp, ps.get_tensor_model_parallel_rank()

    def _queue(self, targets: torch.Tensor, plan: Sequence) -> None:
        if targets.shape[2] != len(self.taps):
            raise ValueError(f"routing replay: {targets.shape[2]} layers of routing for {len(self.taps)} MoE layers")
        _, tp, rank = self._sequence_shards()
        for mb in plan:
            rows = mb.to_rows(targets[mb.seqs], fill=-1)  # [r, L, layers, k] as the model computes them
            rows = _pad_positions(rows, -rows.shape[1] % tp)  # padded positions (-1): natural routing
            for layer, tap in enumerate(self.taps):
                routes = to_router_order(rows[:, :, layer])
                shard = routes.shape[0] // tp  # router order is position-major: rank r's shard is contiguous
                tap.targets.append(routes[rank * shard : (rank + 1) * shard])

    def take(self, seq_len: int, which: str = "used") -> torch.Tensor:
        """The routing recorded since ``forward`` began (``used`` or ``natural``) in the padded layout
        ``[B, S, L, k]`` (its plan's sequences; without a plan the forwards' rows concatenated along
        the batch). Collective over TP with sequence parallelism (the shards of every position,
        gathered once)."""
        calls = [torch.stack(layers, dim=1) for layers in zip(*[getattr(tap, which) for tap in self.taps])]
        if not calls:
            raise RuntimeError("routing: nothing recorded (no forward ran inside Routing.forward)")
        group, tp, _ = self._sequence_shards()
        sizes = [c.shape[0] for c in calls]  # routed tokens per forward on this rank: [s/tp * b, L, k]
        shards = comm.all_gather_cat(torch.cat(calls).to(torch.int32), 0, group)
        shards = shards.view(tp, sum(sizes), *calls[0].shape[1:])  # [TP rank, this rank's tokens, L, k]
        parts = [part.reshape(-1, *part.shape[2:]) for part in shards.split(sizes, dim=1)]  # positions in order
        if self.plan is None:
            padded = seq_len + (-seq_len % tp)
            return torch.cat([from_router_order(p, padded)[:, :seq_len] for p in parts]).to(ROUTE_DTYPE)
        if len(parts) != len(self.plan):
            raise RuntimeError(f"routing: {len(parts)} forwards recorded for a plan of {len(self.plan)} micro-batches")
        out = torch.full((sum(len(mb.seqs) for mb in self.plan), seq_len, *parts[0].shape[1:]), -1,
                         dtype=ROUTE_DTYPE, device=parts[0].device)
        for mb, part in zip(self.plan, parts):
            width = mb.input_ids.shape[1]
            rows = from_router_order(part, width + (-width % tp))[:, :width].to(ROUTE_DTYPE)
            out[mb.seqs] = mb.unpack(rows, fill=-1)[:, :seq_len]
        return out


def to_router_order(routes: torch.Tensor) -> torch.Tensor:
    """``[b, s, k]`` -> the router's token order ``[s * b, k]`` (Megatron is sequence-first)."""
    return routes.transpose(0, 1).reshape(-1, routes.shape[-1])


def from_router_order(routes: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[s * b, ...]`` -> ``[b, s, ...]``."""
    if routes.shape[0] % seq_len:
        raise ValueError(f"routing: {routes.shape[0]} routed tokens is not a multiple of sequence length {seq_len} "
                         "(context parallel MoE routing is not recorded)")
    return routes.view(seq_len, -1, *routes.shape[1:]).transpose(0, 1)


def _pad_positions(routes: torch.Tensor, extra: int) -> torch.Tensor:
    """``[B, S, ...]`` -> ``[B, S + extra, ...]``, the new positions -1 (no routing to replay)."""
    if not extra:
        return routes
    return torch.cat([routes, routes.new_full((routes.shape[0], extra, *routes.shape[2:]), -1)], dim=1)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` x2 -> ``[...]`` bool: the same set of k experts (order ignored)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def generator_routes(rollouts, seq_len: int) -> Optional[torch.Tensor]:
    """R3: the routing vLLM returned per rollout (``[positions, layers, k]`` over prompt +
    completion) as ``[B, seq_len, layers, k]``, -1 where a position has none; None when no
    rollout carries routing."""
    arrays = [r.routed_experts for r in rollouts]
    if all(a is None for a in arrays):
        return None
    shapes = {None if a is None else tuple(a.shape[1:]) for a in arrays}
    if None in shapes or len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"R3: rollouts carry routed experts of inconsistent shapes {sorted(map(str, shapes))}; "
                         "expected [positions, layers, top-k] on every rollout")
    layers, topk = next(iter(shapes))
    out = torch.full((len(arrays), seq_len, layers, topk), -1, dtype=ROUTE_DTYPE)
    for i, a in enumerate(arrays):
        n = min(a.shape[0], seq_len)
        out[i, :n] = torch.as_tensor(a[:n]).to(ROUTE_DTYPE)
    return out


def select_layers(routes: torch.Tensor, layer_numbers: List[int]) -> torch.Tensor:
    """``[B, S, all layers, k]`` -> this stage's MoE layers (1-based global ``layer_numbers``)."""
    if routes.shape[2] < max(layer_numbers):
        raise ValueError(f"R3: the generator returned routing for {routes.shape[2]} layers; the model has "
                         f"MoE layer {max(layer_numbers)}")
    return routes.index_select(2, torch.tensor([n - 1 for n in layer_numbers], device=routes.device))
