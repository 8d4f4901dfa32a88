"""Weights both ways: HF safetensors <-> Megatron-Core parameters, for any TP/PP/EP, every family
``models/families.py`` reads. Which HF tensors make each parameter, and how it is split over TP:
``models/weight_maps.py`` (``ParamMap``, ``RankPlacement``, ``param_maps``, re-exported here)."""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_grpo.models.qwen3 import ModelShape, model_chunks, unwrap
from megatron_grpo.models.weight_maps import ParamMap, RankPlacement, model_tensors, param_maps
from megatron_grpo.parallel import comm

__all__ = ["HFCheckpoint", "ParamMap", "RankPlacement", "export_hf_tensors", "fuse_qkv", "load_hf_weights",
           "param_maps", "shard", "split_qkv", "unshard"]


# ---- splitting full HF tensors into this rank's shard -------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q/k/v ``[heads*d, H]``, ``[groups*d, H]`` x2 -> Megatron fused ``[(heads+2*groups)*d, H]``
    (biases: the same without ``H``)."""
    g, d = shape.num_kv_heads, shape.head_dim
    per = shape.num_heads // g
    parts = [q.reshape(g, per * d, -1), k.reshape(g, d, -1), v.reshape(g, d, -1)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(fused: torch.Tensor, shape: ModelShape, num_groups: int) -> Tuple[torch.Tensor, ...]:
    """Inverse of ``fuse_qkv`` for ``num_groups`` KV groups."""
    d, per = shape.head_dim, shape.num_heads // shape.num_kv_heads
    grouped = fused.reshape(num_groups, (per + 2) * d, -1)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    rest = fused.shape[1:]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def shard(pm: ParamMap, full: Sequence[torch.Tensor], shape: ModelShape, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of parameter ``pm`` from its full HF tensors."""
    if pm.kind == "rep":
        return full[0]
    if pm.kind in ("column", "vocab"):
        return full[0].chunk(size, dim=0)[rank]
    if pm.kind == "row":
        return full[0].chunk(size, dim=1)[rank]
    if pm.kind == "glu":
        return torch.cat([full[0].chunk(size, dim=0)[rank], full[1].chunk(size, dim=0)[rank]], dim=0)
    if pm.kind == "qkv":
        return fuse_qkv(*full, shape).chunk(size, dim=0)[rank]
    raise AssertionError(f"unknown split kind {pm.kind}")


def unshard(pm: ParamMap, shards: Sequence[torch.Tensor], shape: ModelShape, views: bool = False) -> List[torch.Tensor]:
    """Full HF tensors of parameter ``pm`` from every rank's shard (inverse of ``shard``): new tensors,
    or with ``views`` and a single shard (TP = 1) views of it where no copy is needed (the weight push,
    which reads them at once: one copy fewer of every weight)."""
    def join(parts, dim=0):
        return parts[0] if views and len(parts) == 1 else torch.cat(list(parts), dim=dim)

    if pm.kind == "rep":
        return [shards[0]]
    if pm.kind in ("column", "vocab"):
        return [join(shards)]
    if pm.kind == "row":
        return [join(shards, dim=1)]
    if pm.kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [join([h[0] for h in halves]), join([h[1] for h in halves])]
    if pm.kind == "qkv":
        groups = shape.num_kv_heads // len(shards)
        parts = [split_qkv(s, shape, groups) for s in shards]
        return [join([p[i] for p in parts]) for i in range(3)]
    raise AssertionError(f"unknown split kind {pm.kind}")


# ---- HF checkpoint reading ----------------------------------------------------------------------------


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, model_dir: str, filename: Optional[str] = None):
        from safetensors import safe_open

        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, filename or "model.safetensors")
        if filename is None and os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            weight_map = None
        else:
            raise FileNotFoundError(f"no {os.path.basename(single)} (nor model.safetensors.index.json) in {model_dir}")
        self._handles = {}
        files = sorted(set(weight_map.values())) if weight_map else [os.path.basename(single)]
        self.location: Dict[str, str] = {}
        for name in files:
            path = os.path.join(model_dir, name)
            try:
                handle = safe_open(path, framework="pt")
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types
                raise ValueError(f"cannot read checkpoint file {path}: {exc}") from exc
            self._handles[name] = handle
            for key in handle.keys():
                self.location[key] = name

    def describe(self) -> str:
        return ", ".join(os.path.join(self.model_dir, f) for f in self._handles)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.model_dir}")
        file = self.location[name]
        try:
            return self._handles[file].get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"cannot read tensor {name!r} from {os.path.join(self.model_dir, file)}: {exc}") from exc


def load_hf_weights(model, model_dir: str, shape: ModelShape, *, filename: Optional[str] = None,
                    target: Optional[Callable[[str, torch.nn.Parameter], torch.Tensor]] = None) -> None:
    """Copies an HF checkpoint into this rank's Megatron parameters (every param must be covered).

    ``filename`` reads one safetensors file of ``model_dir`` instead of the model files;
    ``target(name, param)`` names another per-parameter tensor to fill (optimizer state).
    """
    ckpt = HFCheckpoint(model_dir, filename)
    place = RankPlacement.current(model)
    params = model_tensors(model)
    maps = param_maps(shape, place)
    unmapped = set(params) - {pm.mcore_name for pm in maps}
    if unmapped:
        raise AssertionError(f"Megatron parameters without an HF source: {sorted(unmapped)[:5]}")
    with torch.no_grad():
        for pm in maps:
            full = [_get_hf(ckpt, name, shape) for name in pm.hf_names]
            rank, size = (place.etp_rank, place.etp) if pm.expert else (place.tp_rank, place.tp)
            try:
                local = shard(pm, full, shape, rank, size)
            except RuntimeError as exc:
                raise ValueError(f"{ckpt.describe()}: tensors {pm.hf_names} have unexpected shapes "
                                 f"{[tuple(t.shape) for t in full]}: {exc}") from exc
            param = params[pm.mcore_name]
            dest = target(pm.mcore_name, param) if target is not None else param
            if local.shape != dest.shape:
                raise ValueError(f"{ckpt.describe()}: tensor {pm.hf_names[0]!r} has shape {tuple(full[0].shape)}, which "
                                 f"gives {tuple(local.shape)} for Megatron's {pm.mcore_name} {tuple(dest.shape)}")
            dest.copy_(local.to(dest.dtype))


def _get_hf(ckpt: HFCheckpoint, name: str, shape: ModelShape) -> torch.Tensor:
    if name == "lm_head.weight" and name not in ckpt.location and shape.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    try:
        return ckpt.get(name)
    except KeyError as exc:
        raise ValueError(f"checkpoint {ckpt.model_dir}: missing tensor {name!r}") from exc


# ---- Megatron -> HF (gathering shards) ----------------------------------------------------------------


def export_hf_tensors(model, shape: ModelShape, *, include_tied_lm_head: bool = True,
                      source: Optional[Callable[[str, torch.nn.Parameter], torch.Tensor]] = None,
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields full HF-named tensors of the whole model, on every rank (collective over TP/EP/PP).

    One parameter (or one layer's experts) is gathered at a time, so at most one layer's
    worth of full tensors exists beyond the model itself. ``source(name, param)`` picks
    another per-parameter tensor of the same shape (an optimizer moment, a master weight).
    With pipeline parallelism the stages take turns, in order; each tensor is broadcast from
    its stage to the others. A list of model chunks (interleaved virtual stages) exports chunk by chunk.
    """
    stage_tensors = (item for chunk in model_chunks(model)
                     for item in _export_stage(chunk, shape, include_tied_lm_head, source))
    pp_group = comm.pipeline_group()
    if comm.group_size(pp_group) == 1:
        yield from stage_tensors
        return
    mine = comm.group_rank(pp_group)
    for stage in range(comm.group_size(pp_group)):
        src = comm.global_rank_in_group(pp_group, stage)
        tensors = stage_tensors if stage == mine else iter(())
        while True:
            item = next(tensors, None)
            header = comm.broadcast_object(None if item is None else (item[0], tuple(item[1].shape), item[1].dtype),
                                           src=src, group=pp_group)
            if header is None:
                break
            name, size, dtype = header
            device = item[1].device if item is not None else _device(model)
            buf = item[1].contiguous() if item is not None else torch.empty(size, dtype=dtype, device=device)
            yield name, comm.broadcast_tensor(buf, src, pp_group)


def _device(model) -> torch.device:
    return next(unwrap(model_chunks(model)[0]).parameters()).device


def _export_stage(model, shape: ModelShape, include_tied_lm_head: bool, source) -> Iterator[Tuple[str, torch.Tensor]]:
    """This pipeline stage's full HF tensors (gathered over TP / ETP / EP)."""
    from megatron.core import parallel_state as ps

    place = RankPlacement.current(model)
    params = model_tensors(model)
    tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    ep_group = ps.get_expert_model_parallel_group()
    for pm in _export_order(shape, place):
        param = params[pm.mcore_name]
        local = (source(pm.mcore_name, param) if source is not None else param).detach()
        if pm.expert:
            yield from _export_expert(pm, local, shape, place, etp_group, ep_group)
            continue
        shards = [local] if pm.kind == "rep" else _gather_shards(local, tp_group)
        for name, tensor in zip(pm.hf_names, unshard(pm, shards, shape)):
            yield name, tensor
            if name == "model.embed_tokens.weight" and shape.tie_word_embeddings and include_tied_lm_head:
                yield "lm_head.weight", tensor


def _export_order(shape: ModelShape, place: RankPlacement) -> List[ParamMap]:
    return [pm for pm in param_maps(shape, place) if not pm.tied_copy]


def _gather_shards(local: torch.Tensor, group) -> List[torch.Tensor]:
    size = comm.group_size(group)
    if size == 1:
        return [local]
    return list(comm.all_gather_cat(local.unsqueeze(0), 0, group).unbind(0))


def _export_expert(pm: ParamMap, local, shape, place, etp_group, ep_group):
    """Gathers one local expert's shards over ETP, then the same local slot over EP."""
    shards = _gather_shards(local, etp_group)
    full = unshard(pm, shards, shape)
    local_e = int(pm.mcore_name.split("local_experts.")[1].split(".")[0])
    per_rank = shape.num_experts // place.ep
    for i, tensor in enumerate(full):
        gathered = _gather_shards(tensor, ep_group)
        for ep_rank, t in enumerate(gathered):
            e = ep_rank * per_rank + local_e
            yield _rename_expert(pm.hf_names[i], e), t


def _rename_expert(hf_name: str, expert: int) -> str:
    """``...{mlp|block_sparse_moe}.experts.<e>.<proj>.weight`` with expert number ``expert``."""
    head, tail = hf_name.split(".experts.")
    return f"{head}.experts.{expert}.{tail.split('.', 1)[1]}"
