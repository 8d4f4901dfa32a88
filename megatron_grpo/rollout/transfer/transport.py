"""Trainer side of vLLM's weight-transfer API: which transport, the handshake, one push.

``generation.weight_transfer`` picks how pushed buckets reach an engine:

- ``file``: each bucket a safetensors file (under /dev/shm when it fits: ``fanout.py``) whose path
  the engine's worker extension reads; same host only.
- ``gloo``: vLLM's weight-transfer API with our gloo engine (``gloo_transfer.py``): CPU, any host
  the server's workers can open a TCP connection to the trainer from (buckets gathered on a GPU
  are copied to host before they are sent).
- ``nccl`` / ``ipc``: the same API with vLLM's own engines (dedicated / colocated GPUs).
- ``auto``: ``file`` for offline ``vllm`` engines (same host), the API for ``vllm_server``: gloo
  without CUDA, else ipc (colocated) or nccl (dedicated).

An engine that uses the API is its own control-plane client (vLLM's ``VLLMWeightSyncClient``
protocol: ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), over HTTP (server) or its generator process (offline ``LLM``).
``VLLMTransfer`` opens the transfer once (the first push) and drives every push.
"""

from __future__ import annotations

import hashlib
import socket
from typing import Callable, Iterable, List, Optional, Tuple
from urllib.parse import urlparse

import torch

from megatron_grpo.parallel.net import route_address
from megatron_grpo.rollout.transfer import delta, gloo_transfer
from megatron_grpo.rollout.transfer.gloo_transfer import TransferEndpoint

API_TRANSPORTS = ("gloo", "nccl", "ipc")
DELTA_TRANSPORTS = ("file", "gloo")
"""Transports whose receiving side applies delta patches (``delta.py``); the others get full pushes."""
Bucket = List[Tuple[str, torch.Tensor]]


def resolve_transport(transport: str, backend: str, *, colocated: bool, cuda: bool, trainer_ranks: int = 1,
                      num_engines: int = 1, tensor_parallel_size: int = 1) -> str:
    """The transport ``generation.weight_transfer`` means for this engine backend, layout and machine
    (``auto`` resolved); ``ValueError`` naming the key for a transport that cannot run here.

    vLLM's ipc trainer engine fits one case only: one trainer rank, one engine, TP 1. It all-gathers
    the IPC handles over the trainer's default group (every rank would have to push, but only rank 0
    holds the gathered weights) and keys them by rank 0's GPU (a worker on another GPU finds none).
    Other colocated layouts push files (same host, /dev/shm); nccl cannot put two ranks on one GPU."""
    ipc_fits = trainer_ranks == 1 and num_engines == 1 and tensor_parallel_size == 1
    if transport == "auto":
        if backend != "vllm_server":
            return "file"
        if not cuda:
            return "gloo"
        if not colocated:
            return "nccl"
        return "ipc" if ipc_fits else "file"
    if transport in ("nccl", "ipc") and not cuda:
        raise ValueError(f"generation.weight_transfer={transport} needs CUDA (vLLM's {transport} engine); use gloo "
                         "or file on CPU")
    if transport == "ipc" and not ipc_fits:
        raise ValueError(f"generation.weight_transfer=ipc needs one trainer rank, generation.num_engines=1 and "
                         f"generation.tensor_parallel_size=1 (got {trainer_ranks} rank(s), {num_engines}, "
                         f"{tensor_parallel_size}): vLLM's ipc engine gathers handles over every trainer rank and "
                         "keys them by rank 0's GPU. Use file (colocated, same host) or auto")
    return transport


def free_port(host: str) -> int:
    """A free TCP port (on loopback for loopback, else on every interface, as the group's store listens)."""
    with socket.socket() as s:
        s.bind((host if host.startswith("127.") else "", 0))
        return s.getsockname()[1]


def default_address(server_url: Optional[str]) -> str:
    """Where the generator's workers reach trainer rank 0: loopback for local engines, else the address
    of this host's interface that routes to the server (``parallel.net.route_address``)."""
    if server_url is None:
        return "127.0.0.1"

    return route_address(urlparse(server_url).hostname or "127.0.0.1")


class VLLMTransfer:
    """One engine's transfer over vLLM's API (``backend`` gloo, nccl or ipc); ``client`` is the engine."""

    def __init__(self, backend: str, client, *, address: str = "127.0.0.1", num_workers: int = 1,
                 num_senders: int = 1, timeout_s: float = 600.0):
        """``num_senders`` (gloo): trainer ranks that send (one per pipeline stage); this object is
        sender 0, the others open ``GlooSender(self.endpoint, index)`` on their ranks while it opens."""
        if backend not in API_TRANSPORTS:
            raise ValueError(f"generation.weight_transfer: {backend!r} is not a vLLM weight-transfer backend "
                             f"({', '.join(API_TRANSPORTS)})")
        if num_senders != 1 and backend != "gloo":
            raise ValueError(f"generation.weight_transfer={backend}: vLLM's {backend} engine takes one sender")
        self.backend, self.client = backend, client
        self.endpoint = TransferEndpoint(address, free_port(address), num_senders, num_workers, timeout_s)
        self._sender = None  # gloo: our sender; nccl / ipc: vLLM's trainer engine
        self._meta = None  # nccl / ipc: (name, dtype, shape) of every pushed tensor, learnt on the first push
        self.bytes_sent = 0

    @property
    def opened(self) -> bool:
        return self._sender is not None

    def set_senders(self, num_senders: int) -> None:
        """Pushes come from ``num_senders`` trainer ranks (gloo: one per pipeline stage, ``stage_push.py``); a
        transfer open with another count is closed, and the next push opens a new group."""
        if num_senders == self.endpoint.num_senders:
            return
        if self.backend != "gloo":
            raise ValueError(f"generation.weight_transfer={self.backend}: vLLM's {self.backend} engine takes one sender")
        self.close()
        self.endpoint.num_senders, self.endpoint.master_port = num_senders, free_port(self.endpoint.master_address)

    def set_address(self, address: str) -> None:
        """The group meets at ``address`` (one every sender and worker reaches); an open transfer is closed."""
        if address != self.endpoint.master_address:
            self.close()
            self.endpoint.master_address, self.endpoint.master_port = address, free_port(address)

    def open(self) -> None:
        """The handshake (once): the engine's workers join the group inside ``init_weight_transfer_engine``."""
        if self.backend == "gloo":
            self._sender = gloo_transfer.open_transfer(self.client, self.endpoint)
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self._sender = WeightTransferTrainerFactory.trainer_init(self._init_info(), client=self.client,
                                                                 source=bucket_source([]))

    def _init_info(self):
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            e = self.endpoint
            return NCCLTrainerInitInfo(master_address=e.master_address, master_port=e.master_port,
                                       world_size=e.world_size, rank=0)
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0, packed=True)  # bounded buffers: one round never holds the whole model

    def push(self, buckets: Iterable[Bucket], version: int) -> List[str]:
        """Sends one version; returns the names sent. The buckets are consumed whatever happens (their
        gathers are collective on the other ranks). After a failure the transfer is closed; the next
        push opens a new one."""
        buckets = iter(buckets)
        try:
            if not self.opened:
                self.open()
            if self.backend == "gloo":
                names = gloo_transfer.push_round(self.client, self._sender, buckets, version)
                self.bytes_sent = self._sender.bytes_sent
                return names
            return self._push_rounds(buckets, version)
        except BaseException:
            self.close()
            self.endpoint.master_port = free_port(self.endpoint.master_address)
            self._meta = None  # the next push learns it again, from what it sends
            raise
        finally:
            for _ in buckets:
                pass

    def _push_rounds(self, buckets: Iterable[Bucket], version: int) -> List[str]:
        """vLLM's nccl / ipc trainer engines send one ``WeightSource`` per round (start, update, finish),
        its metadata declared before any tensor moves. The first push learns the names, dtypes and
        shapes, one round per bucket (buckets close between layers, so each round's layerwise reload
        sees whole layers); every later push is one round over all buckets with the learnt metadata
        (one reload, and vLLM's own check that the stream matches what it declared)."""
        names: List[str] = []
        if self._meta is None:
            meta = []
            for bucket in buckets:
                self._sender.source = bucket_source(bucket)
                self._sender.send_weights()
                names.extend(n for n, _ in bucket)
                meta.extend((n, t.dtype, tuple(t.shape)) for n, t in bucket)
                self.bytes_sent += sum(t.numel() * t.element_size() for _, t in bucket)
            self._meta = meta
        else:
            def stream():
                for bucket in buckets:
                    for name, tensor in bucket:
                        names.append(name)
                        self.bytes_sent += tensor.numel() * tensor.element_size()
                        yield name, tensor

            self._sender.source = bucket_source(stream(), self._meta)
            self._sender.send_weights()
        self.client.update_weight_version(str(version))
        return names

    def close(self) -> None:
        if self._sender is None:
            return
        try:
            if self.backend == "gloo":
                self._sender.close()
            else:
                self._sender.shutdown()
        except Exception:  # noqa: BLE001 - the peer may be gone
            pass
        self._sender = None


def bucket_source(bucket, meta: Optional[List[Tuple[str, torch.dtype, tuple]]] = None):
    """A vLLM ``WeightSource`` over (HF name, tensor) pairs: one bucket (its metadata read from it), or
    a one-pass stream whose metadata ``meta`` (name, dtype, shape) is known before it is drawn."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class BucketSource(WeightSource):
        def metadata(self):
            if meta is not None:
                return [ParamMeta(n, d, s) for n, d, s in meta]
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in bucket]

        def __iter__(self):
            return iter(bucket)

    return BucketSource()


DIGEST_MAX_NUMEL = 1 << 20
"""Pushed tensors up to this size get a trainer-side checksum (norms, biases, small embeddings):
hashing every tensor of a large model would cost seconds per push."""


def digesting(buckets: Iterable[Bucket], out: dict,
              keep: Optional[Callable[[str, torch.Tensor], bool]] = None) -> Iterable[Bucket]:
    """Passes ``buckets`` through, recording into ``out`` the sha256 of each small pushed tensor (of a
    delta patch: the full tensor's, which the patch carries) that ``keep`` (the engine holds it byte for
    byte: ``fp8_hf.engine_keeps_bytes``; None = all) accepts."""
    for bucket in buckets:
        out.update(trainer_digests((n, t) for n, t in bucket if t.numel() <= DIGEST_MAX_NUMEL and delta.DELIM not in n
                                   and n != delta.DELTA_MARK and (keep is None or keep(n, t))))
        out.update({n[:-len(delta.SHA256)]: bytes(t.numpy()).hex() for n, t in bucket if n.endswith(delta.SHA256)})
        yield bucket


def trainer_digests(named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> dict:
    """sha256 of each pushed tensor's bytes, as vLLM's ``/weight_checker`` computes them."""
    return {n: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in named_tensors}


EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
"""sha256 of no bytes: a parameter vLLM's CPU kernels repacked elsewhere (its own storage is empty)."""


def compare_checksums(engine_digests: dict, ours: dict) -> Tuple[int, Optional[str]]:
    """(tensors compared, first mismatching name or None) over the names both sides hold. Engine keys
    carry vLLM's ``dp0:pp0:pcp0:tp0:`` prefix, one per worker holding the name. A name whose workers
    report one digest and one of them ours is replicated (norms): every worker must hold ours. Differing
    digests with none ours are TP shards (no worker holds the full tensor): skipped; so are parameters
    vLLM's CPU kernels repacked elsewhere (empty). Otherwise (one digest, not ours) it is a mismatch."""
    by_name: dict = {}
    for key, digest in engine_digests.items():
        by_name.setdefault(key.rpartition(":")[2], []).append(digest)
    compared, mismatch = 0, None
    for name in sorted(by_name):
        digests = set(by_name[name])
        if name not in ours or EMPTY_DIGEST in digests or (len(digests) > 1 and ours[name] not in digests):
            continue
        compared += 1
        if digests != {ours[name]} and mismatch is None:
            mismatch = name
    return compared, mismatch
