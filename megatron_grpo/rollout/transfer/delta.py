"""Delta weight push (``generation.delta_push``): after a full push, only the elements whose
generation-dtype value changed travel, as a flat-index + value patch per tensor.

Trainer side (``DeltaState``, one per rank): each rank keeps a generation-dtype copy of the shards
it sends (its own shards only, and only those it sends: no rank holds the whole model) and compares
its freshly cast shard bit for bit with that copy (``changed``), updating the copy in place. A
multi-rank gather (``weight_sync``) then never carries more bytes per rank than the dense one: the
group agrees on its largest count of changed elements, and when a patch of that many (index, value)
pairs is smaller than the shard every rank sends one (``pack_changes``, padded to that count), else
every rank sends its values and all count as changed. The sender then holds, per full tensor, values
that are exact where its mask is set; tensors small enough to be checksummed are completed from a full
copy it keeps of them (``settle``), larger ones are always sent as patches (``encode``). Otherwise the
sender turns each full tensor + mask into a patch unless the patch (int32/int64 indices + values) would
be at least the dense bytes. Which pushes are full is decided identically on every rank (``start``):
the first, the one after an engine restart (``force_full``), and every ``full_every``-th.

Wire format: a patch of tensor ``N`` is the bucket entries ``N::delta_index`` (int32, or int64 past
2**31 elements), ``N::delta_value`` (generation dtype) and, for tensors the parity probe checksums,
``N::delta_sha256`` (32 uint8: the sha256 of the full tensor's bytes, so ``transport.digesting``
records the same digest a dense push would). Every bucket of a delta push carries ``DELTA_MARK``.
Any transport that carries (name, tensor) buckets can carry this; the file transport's worker
extension (``server_ext.py``) and the gloo weight-transfer engine (``gloo_engine.py``) apply it.
vLLM's own nccl and ipc engines do not: they load what arrives as it is, and the nccl trainer side
declares every tensor's shape before the round (a patch's shape changes every push).

Engine side (``DeltaReceiver``, one per vLLM worker and transport): a host copy of the last full tensors of every
pushed name; a patch is applied to that copy and the full tensor goes through vLLM's layerwise
reload exactly as a dense push would (so the engine's weights are bit-identical to a dense push's).
vLLM 0.32 also ships a sparse path (``load_checkpoint_weight_patches``, used by its
``sparse_nccl`` engine): it writes patches into the runtime parameters in place, bypassing the
layerwise reload, and needs loaders whose last step is a same-shaped ``copy_``; vLLM's CPU kernels
re-pack weights after loading (fused MoE experts, linear layouts), so that path does not fit here.
The host copy costs one generation-dtype copy of the model per worker.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

DELIM = "::delta_"
INDEX, VALUE, SHA256 = DELIM + "index", DELIM + "value", DELIM + "sha256"
DELTA_MARK = "megatron_grpo::delta_push"
"""An entry in every bucket of a delta-push run: the receiver keeps host copies while it sees it."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Entry = Tuple[str, torch.Tensor]


def mark() -> Entry:
    return DELTA_MARK, torch.ones(1, dtype=torch.uint8)


@dataclass
class DeltaState:
    """One trainer rank's delta-push state; every rank calls ``start`` / ``finish`` on every push."""

    full_every: int = 0
    """A full push every this many pushes (0 = only the first and after a restart)."""
    force_full: bool = False
    """Set on every rank when an engine restarted: the next push is full."""
    num_pushes: int = 0
    since_full: int = 0
    full: bool = True
    """This push is full (no masks gathered): the same on every rank."""
    shards: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> this rank's shard as last sent (generation dtype): the shards it sends only."""
    fulls: Dict[str, torch.Tensor] = field(default_factory=dict)
    """The sender: HF name -> the full tensor as last sent, for tensors gathered from several ranks that are
    small enough to be checksummed (their patches carry the full tensor's sha256)."""
    patches_agreed: Optional[bool] = None
    """Whether the engine applies patches (global rank 0 holds it; every rank learns it on the first delta
    push): if not, every push is full."""

    def start(self) -> bool:
        self.full = (self.num_pushes == 0 or self.force_full
                     or (self.full_every > 0 and self.since_full >= self.full_every))
        return self.full

    def finish(self) -> None:
        self.num_pushes += 1
        self.since_full = 1 if self.full else self.since_full + 1
        self.force_full = False

    def changed(self, key: str, local: torch.Tensor, owned: bool = True) -> Optional[torch.Tensor]:
        """uint8 mask of the elements of ``local`` (this rank's cast shard) whose bits differ from what
        this rank last sent, or None on a full push; remembers ``local`` as sent: a full push keeps it
        (a copy where it is not ``owned``: a view of the live parameter), a delta push copies it into
        the kept shard in place (no new copy)."""
        prev = self.shards.get(key)
        if self.full:
            self.shards[key] = local if owned else local.clone()
            return None
        assert prev is not None and prev.shape == local.shape, f"delta push: no shard of {key} from the last push"
        ints = _INT_OF_SIZE[local.element_size()]
        mask = (local.view(ints) != prev.view(ints)).to(torch.uint8)
        prev.copy_(local)
        return mask

    def settle(self, name: str, full: torch.Tensor, mask: Optional[torch.Tensor], partial: bool,
               digest_max_numel: int) -> Tuple[torch.Tensor, bool]:
        """The sender, for a tensor gathered from several ranks: (the tensor, whether its values are exact).
        ``partial``: exact only where ``mask`` is set (patches from other ranks). A tensor that is
        checksummed (at most ``digest_max_numel`` elements) is completed from the kept full copy, which it
        then replaces; a larger partial one can only be sent as a patch."""
        if full.numel() > digest_max_numel:
            return full, not partial
        if partial:
            full = torch.where(mask.bool(), full, self.fulls[name])
        self.fulls[name] = full
        return full, True


def index_dtype(numel: int) -> torch.dtype:
    """Flat indices into ``numel`` elements: int32, or int64 past 2**31."""
    return torch.int32 if numel < 2**31 else torch.int64


def patch_fits(num_changed: int, numel: int, element_size: int) -> bool:
    """A patch of ``num_changed`` (index, value) pairs is smaller than the ``numel`` values themselves."""
    index_size = torch.empty((), dtype=index_dtype(numel)).element_size()
    return num_changed * (index_size + element_size) < numel * element_size


def pack_changes(local: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 ``[count * (index + value bytes)]``: ``local``'s changed elements as flat indices (padded with
    -1) then their values, padded to ``count`` (the gather group's largest), for a gather of one shape."""
    changed = mask.reshape(-1).nonzero().view(-1)
    index = torch.full((count,), -1, dtype=index_dtype(local.numel()), device=local.device)
    values = torch.zeros(count, dtype=local.dtype, device=local.device)
    index[:changed.numel()] = changed
    values[:changed.numel()] = local.reshape(-1)[changed]
    return torch.cat([index.view(torch.uint8), values.view(torch.uint8)])


def unpack_changes(packed: torch.Tensor, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``pack_changes``' bytes -> (values shaped like ``like``, 0 where unchanged; the uint8 change mask)."""
    idx_dtype = index_dtype(like.numel())
    index_size = torch.empty((), dtype=idx_dtype).element_size()
    count = packed.numel() // (index_size + like.element_size())
    index = packed[:count * index_size].view(idx_dtype)
    values = packed[count * index_size:].view(like.dtype)
    keep = index >= 0
    index = index[keep].long()
    full, mask = torch.zeros_like(like), torch.zeros(like.shape, dtype=torch.uint8, device=like.device)
    full.view(-1)[index] = values[keep]
    mask.view(-1)[index] = 1
    return full, mask


def encode(name: str, full: torch.Tensor, mask: torch.Tensor, digest_max_numel: int,
           exact: bool = True) -> Tuple[List[Entry], bool]:
    """(bucket entries, is a patch) of one full tensor: its patch when smaller than the dense bytes,
    else the tensor itself; always the patch when the values are ``exact`` only where ``mask`` is set."""
    numel = full.numel()
    if exact and not patch_fits(int(mask.count_nonzero()), numel, full.element_size()):
        return [(name, full)], False
    flat = full.contiguous().view(-1)
    index = mask.reshape(-1).nonzero().view(-1)
    entries = [(name + INDEX, index.to(index_dtype(numel))), (name + VALUE, flat[index])]
    if numel <= digest_max_numel:
        assert exact, f"delta push: {name} is checksummed but its values are not all known"
        digest = hashlib.sha256(flat.view(torch.uint8).numpy()).digest()
        entries.append((name + SHA256, torch.frombuffer(bytearray(digest), dtype=torch.uint8)))
    return entries, True


def entry_bytes(entries: List[Entry]) -> int:
    return sum(t.numel() * t.element_size() for _, t in entries)


def split_name(name: str) -> Tuple[str, Optional[str]]:
    """(tensor name, patch part ``index``/``value``/``sha256`` or None for a plain tensor)."""
    if DELIM not in name:
        return name, None
    base, part = name.rsplit(DELIM, 1)
    return base, part


class DeltaReceiver:
    """The engine side: full tensors from buckets that may hold patches (see the module docstring)."""

    def __init__(self):
        self.base: Dict[str, torch.Tensor] = {}

    def apply(self, bucket: List[Entry]) -> List[Entry]:
        """The bucket's full (name, tensor) pairs, in order, patches applied to the host copies.
        Without ``DELTA_MARK`` (delta push off) nothing is kept."""
        keep = any(name == DELTA_MARK for name, _ in bucket)
        if not keep:
            self.base.clear()
            return bucket
        out, index = [], {}
        for name, tensor in bucket:
            base, part = split_name(name)
            if name == DELTA_MARK or part == SHA256[len(DELIM):]:
                continue
            if part is None:
                self.base[name] = tensor.clone()
                out.append((name, self.base[name]))
            elif part == "index":
                index[base] = tensor
            else:
                if base not in self.base:
                    raise RuntimeError(f"delta push: a patch of {base} arrived, but this engine holds no full copy "
                                       "of it (restarted since the last full push?); a full push is needed")
                self.base[base].view(-1)[index.pop(base).long()] = tensor
                out.append((base, self.base[base]))
        return out
