"""Delta weight push (``generation.delta_push``): after a full push, only the elements whose
generation-dtype value changed travel, as a flat-index + value patch per tensor.

Trainer side (``DeltaState``, one per rank): each rank keeps a generation-dtype copy of the shards
it last sent (its own shards only: no rank holds the whole model) and, before the gather, compares
its freshly cast shard bit for bit with that copy (``changed``); the uint8 change masks are gathered
with the values (``weight_sync``), and the sending rank turns each full tensor + mask into a patch
(``encode``) unless the patch (int32/int64 indices + values) would be at least the dense bytes.
Which pushes are full is decided identically on every rank (``start``): the first, the one after an
engine restart (``force_full``), and every ``full_every``-th.

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
    """Parameter name -> this rank's shard as last sent (generation dtype)."""

    def start(self) -> bool:
        self.full = (self.num_pushes == 0 or self.force_full
                     or (self.full_every > 0 and self.since_full >= self.full_every))
        return self.full

    def finish(self) -> None:
        self.num_pushes += 1
        self.since_full = 1 if self.full else self.since_full + 1
        self.force_full = False

    def changed(self, key: str, local: torch.Tensor) -> Optional[torch.Tensor]:
        """uint8 mask of the elements of ``local`` (this rank's cast shard) whose bits differ from what
        this rank last sent, or None on a full push; remembers ``local`` as sent."""
        prev = self.shards.get(key)
        self.shards[key] = local
        if self.full:
            return None
        assert prev is not None and prev.shape == local.shape, f"delta push: no shard of {key} from the last push"
        ints = _INT_OF_SIZE[local.element_size()]
        return (local.view(ints) != prev.view(ints)).to(torch.uint8)


def encode(name: str, full: torch.Tensor, mask: torch.Tensor, digest_max_numel: int) -> Tuple[List[Entry], bool]:
    """(bucket entries, is a patch) of one full tensor: its patch when smaller than the dense bytes,
    else the tensor itself."""
    numel = full.numel()
    idx_dtype = torch.int32 if numel < 2**31 else torch.int64
    num_changed = int(mask.count_nonzero())
    patch_bytes = num_changed * (torch.empty((), dtype=idx_dtype).element_size() + full.element_size())
    if patch_bytes >= numel * full.element_size():
        return [(name, full)], False
    flat = full.contiguous().view(-1)
    index = mask.reshape(-1).nonzero().view(-1)
    entries = [(name + INDEX, index.to(idx_dtype)), (name + VALUE, flat[index])]
    if numel <= digest_max_numel:
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
