"""The project's collective helpers (torchtitan's ``dist_sum``/``dist_max`` idea).

Loss and metric code calls these instead of ``torch.distributed`` so that it stays
rank-agnostic: with ``group=None`` (or an uninitialised default group) every helper is
the identity, i.e. the single-process computation.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist


def _active(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_size(group=None) -> int:
    """Number of ranks in ``group`` (1 when not distributed)."""
    return dist.get_world_size(group) if _active(group) else 1


def group_rank(group=None) -> int:
    """This process's rank inside ``group`` (0 when not distributed)."""
    return dist.get_rank(group) if _active(group) else 0


def collective_device(preferred: Optional[torch.device] = None, group=None) -> torch.device:
    """The device a tensor must be on for a collective over ``group``: the current CUDA device
    for NCCL groups, the CPU for gloo (and when not distributed: ``preferred`` or the CPU)."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device(preferred) if preferred is not None else torch.device("cpu")


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    """In-place all-reduce. A tensor on another device than the group's backend needs (a CPU
    tensor under NCCL, a CUDA tensor under gloo) goes through a temporary copy; the step keeps
    its tensors on the model's device, so this is the exception, not the path."""
    if not _active(group):
        return tensor
    device = collective_device(tensor.device, group)
    if tensor.device == device:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return tensor.copy_(moved)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM all-reduce over ``group``; returns ``tensor``."""
    return _all_reduce(tensor, dist.ReduceOp.SUM, group)


def all_reduce_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place MAX all-reduce over ``group``; returns ``tensor``."""
    return _all_reduce(tensor, dist.ReduceOp.MAX, group)


def all_gather_cat(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenates equal-shaped ``tensor`` from every rank of ``group`` along ``dim``."""
    if not _active(group):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def barrier(group=None) -> None:
    """Every rank of ``group`` has reached this point (nothing when not distributed)."""
    if _active(group):
        dist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group: Optional[object] = None):
    """Broadcasts a picklable object from global rank ``src``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def broadcast_tensor(tensor: torch.Tensor, src_global_rank: int, group=None) -> torch.Tensor:
    """In-place broadcast of ``tensor`` from global rank ``src_global_rank`` over ``group``."""
    if _active(group):
        dist.broadcast(tensor, src=src_global_rank, group=group)
    return tensor


def global_rank_in_group(group, group_rank_: int) -> int:
    """Global rank of the member with rank ``group_rank_`` in ``group``."""
    return dist.get_global_rank(group, group_rank_) if _active(group) else (dist.get_rank() if dist.is_initialized() else 0)


def world_group():
    """The default (world) process group, or None when not distributed."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def all_gather_object(obj, group=None) -> list:
    """``[obj of group rank 0, obj of group rank 1, ...]`` (``[obj]`` when not distributed)."""
    if not _active(group):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj, dst: int = 0) -> Optional[list]:
    """``[obj of rank 0, obj of rank 1, ...]`` of the world on global rank ``dst``, None elsewhere (``[obj]`` when
    not distributed). Metadata only (names, numbers, strings)."""
    if not _active(world_group()):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def pipeline_group():
    """This rank's pipeline-parallel group (None before Megatron's parallel state exists)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group() if ps.model_parallel_is_initialized() else None


def pipeline_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over this rank's pipeline stages (a new tensor on its device; PP = 1: ``tensor``)."""
    group = pipeline_group()
    if group_size(group) == 1:
        return tensor
    summed = tensor.to(collective_device(tensor.device, group), copy=True)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    return summed.to(tensor.device)


def _last_stage_source():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_last_rank(), ps.is_pipeline_last_stage()


def tensor_from_last_stage(tensor: Optional[torch.Tensor], shape, dtype: torch.dtype,
                           device: torch.device) -> torch.Tensor:
    """The last pipeline stage's ``tensor`` on every stage of this rank's pipeline (the other
    stages pass None and get a tensor of ``shape`` / ``dtype`` on ``device``); PP = 1: ``tensor``."""
    group = pipeline_group()
    if group_size(group) == 1:
        return tensor
    src, is_last = _last_stage_source()
    target = collective_device(device, group)
    buf = tensor.to(target).contiguous() if is_last else torch.empty(shape, dtype=dtype, device=target)
    dist.broadcast(buf, src=src, group=group)
    return buf.to(device)


def scalars_from_last_stage(values: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    """The last pipeline stage's named float64 scalars on every stage of this rank's pipeline, on
    ``device`` (the other stages pass anything, e.g. ``{}``; PP = 1: ``values``). The names travel as
    metadata, the values as one tensor broadcast on the group's device: a pickled CUDA tensor would
    be unpickled onto the *sender's* device index on every receiver."""
    group = pipeline_group()
    if group_size(group) == 1:
        return values
    src, is_last = _last_stage_source()
    names = object_from_last_stage(sorted(values) if is_last else None)
    if not names:
        return {}
    target = collective_device(device, group)
    if is_last:
        buf = torch.stack([values[n].detach().to(device=target, dtype=torch.float64).reshape(()) for n in names])
    else:
        buf = torch.empty(len(names), dtype=torch.float64, device=target)
    dist.broadcast(buf, src=src, group=group)
    return dict(zip(names, buf.to(device).unbind(0)))


def object_from_last_stage(obj):
    """A picklable object of the last pipeline stage on every stage (PP = 1: ``obj``). Metadata only
    (names, strings, numbers): tensors go through ``tensor_from_last_stage`` / ``scalars_from_last_stage``."""
    group = pipeline_group()
    if group_size(group) == 1:
        return obj
    src, _ = _last_stage_source()
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


# ---- point-to-point and rooted collectives (the weight push: full tensors only where they are sent) ------


def group_ranks(group) -> list:
    """The global ranks of ``group``'s members (``[this rank]`` when not distributed)."""
    if not _active(group):
        return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
    return dist.get_process_group_ranks(group)


def gather_to(tensor: torch.Tensor, dst_global_rank: int, group=None) -> Optional[list]:
    """``[tensor of group rank 0, ...]`` on global rank ``dst_global_rank`` (a member of ``group``),
    None elsewhere: unlike ``all_gather_cat`` only the destination ever holds the full set."""
    if not _active(group):
        return [tensor]
    device = collective_device(tensor.device, group)
    send = tensor.detach().to(device).contiguous()
    parts = [torch.empty_like(send) for _ in range(dist.get_world_size(group))] if dist.get_rank() == dst_global_rank \
        else None
    dist.gather(send, parts, dst=dst_global_rank, group=group)
    return None if parts is None else [p.to(tensor.device) for p in parts]


def send_tensor(tensor: torch.Tensor, dst_global_rank: int) -> None:
    """Point-to-point send over the default group (on the backend's device)."""
    dist.send(tensor.detach().to(collective_device(tensor.device)).contiguous(), dst=dst_global_rank)


def recv_tensor(shape, dtype: torch.dtype, src_global_rank: int, device: torch.device) -> torch.Tensor:
    """Receives a tensor of ``shape`` / ``dtype`` sent by ``send_tensor``; returns it on ``device``."""
    buf = torch.empty(shape, dtype=dtype, device=collective_device(device))
    dist.recv(buf, src=src_global_rank)
    return buf.to(device)


def send_object(obj, dst_global_rank: int) -> None:
    """Sends picklable metadata (no tensors) point-to-point."""
    dist.send_object_list([obj], dst=dst_global_rank)


def recv_object(src_global_rank: int):
    box = [None]
    dist.recv_object_list(box, src=src_global_rank)
    return box[0]
