"""A gloo weight-transfer engine for vLLM's RL weight-sync API (CPU; any host the trainer can reach).

vLLM 0.32 moves trainer weights into its workers through ``vllm.distributed.weight_transfer``
engines (``nccl`` for dedicated GPUs, ``ipc`` for colocated ones), driven by
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` (``LLM`` methods offline, HTTP routes on the server). Neither runs
without CUDA, so this module adds ``gloo``: registered with
``WeightTransferEngineFactory.register_engine`` by ``register()``, the ``vllm.general_plugins``
entry point of this package (vLLM calls it in every engine process), so a plain
``python -m vllm.entrypoints.openai.api_server ... --weight-transfer-config '{"backend": "gloo"}'``
accepts it.

The group: ``num_senders`` trainer ranks (0 .. S-1; sender 0 hosts the TCP store at
``master_address:master_port``) plus every vLLM worker (S + worker rank), one stateless gloo
process group (vLLM's ``stateless_init_torch_distributed_process_group``: it never touches the
trainer's or vLLM's own default groups). Several senders (one per pipeline stage) feed one engine:
each streams its own buckets; the worker receives from all of them at once and loads whatever
arrives. One bucket on the wire is three point-to-point messages from a sender to each worker:

- a header, int64 ``[kind, meta_bytes, payload_bytes]`` (kind: ``BUCKET``, ``END`` of this
  sender's push, ``ABORT`` with the sender's error as meta);
- meta: JSON ``{"names", "dtypes", "shapes", "sizes"}``;
- payload: the bucket packed into one uint8 buffer (vLLM's ``packed_tensor.pack_tensors``;
  the worker unpacks with ``unpack_tensor``).

vLLM's engine classes (the worker's receiver, the trainer-engine interface) live in
``gloo_engine.py``, which vLLM's factory imports only when ``gloo`` is chosen.
"""

from __future__ import annotations

import json
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, List, Optional, Tuple

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from megatron_grpo.compat.vllm import pack_tensors, register_weight_transfer_engine, unpack_tensors
from megatron_grpo.parallel.net import route_address

BACKEND = "gloo"
ENGINES_MODULE = "megatron_grpo.rollout.transfer.gloo_engine"
"""vLLM's engine classes for gloo (imported by vLLM's factory when the backend is chosen)."""
BUCKET, END, ABORT = 1, 0, 2
_TAG = 7  # every message of the transfer group uses this tag (order is per sender-receiver pair)
Bucket = List[Tuple[str, torch.Tensor]]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: adds ``gloo`` to vLLM's weight-transfer factories.
    Runs once per vLLM process (and may run again: idempotent)."""
    register_weight_transfer_engine(BACKEND, ENGINES_MODULE, "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine")


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """This process's member of the transfer group (rank 0 hosts the store at ``host:port``): a gloo
    backend of its own, as vLLM's ``stateless_init_torch_distributed_process_group`` makes (the
    trainer's and vLLM's default groups are never touched), but with gloo's device bound to
    ``route_address(host)``. Left to itself gloo binds whatever the hostname resolves to, and a member
    on another host (network namespace) then waits for pairs it can never connect (measured: a hang)."""
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=route_address(host))]
    return ProcessGroupGloo(PrefixStore("megatron_grpo/weight_transfer/", store), rank, world_size, options)


# ---- the wire -----------------------------------------------------------------------------------------------


def _send(pg, tensor: torch.Tensor, dst: int) -> None:
    pg.send([tensor], dst, _TAG).wait()


def _recv(pg, tensor: torch.Tensor, src: int) -> torch.Tensor:
    pg.recv([tensor], src, _TAG).wait()
    return tensor


def send_message(pg, dst_ranks: Iterable[int], kind: int, meta: bytes = b"", payload: Optional[torch.Tensor] = None):
    header = torch.tensor([kind, len(meta), 0 if payload is None else payload.numel()], dtype=torch.int64)
    meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8) if meta else None
    for dst in dst_ranks:
        _send(pg, header, dst)
        if meta_t is not None:
            _send(pg, meta_t, dst)
        if payload is not None and payload.numel():
            _send(pg, payload, dst)


def recv_message(pg, src: int) -> Tuple[int, bytes, Optional[torch.Tensor]]:
    kind, num_meta, num_payload = _recv(pg, torch.empty(3, dtype=torch.int64), src).tolist()
    meta = bytes(_recv(pg, torch.empty(num_meta, dtype=torch.uint8), src).numpy()) if num_meta else b""
    payload = _recv(pg, torch.empty(num_payload, dtype=torch.uint8), src) if num_payload else None
    return kind, meta, payload


def pack_bucket(bucket: Bucket) -> Tuple[bytes, torch.Tensor]:
    """(JSON meta, one uint8 host buffer) of a bucket, with vLLM's packer. Buckets gathered on the
    trainer's GPU are packed there and copied to host once: gloo's TCP transport reads the buffer
    through its data pointer, which for a CUDA tensor is a device address (it must never be sent)."""
    names, dtypes, shapes, sizes, buffer = pack_tensors(bucket)
    meta = dict(names=names, dtypes=[str(d).split(".")[-1] for d in dtypes], shapes=shapes, sizes=sizes)
    if buffer.device.type != "cpu":
        buffer = buffer.cpu()
    return json.dumps(meta).encode(), buffer


def unpack_bucket(meta: bytes, payload: torch.Tensor) -> Bucket:
    m = json.loads(meta)
    return unpack_tensors(payload, m["names"], m["shapes"], [getattr(torch, d) for d in m["dtypes"]], m["sizes"])


# ---- trainer side -------------------------------------------------------------------------------------------


@dataclass
class TransferEndpoint:
    """Where the transfer group meets: the address the generator's workers reach sender 0's store at."""

    master_address: str
    master_port: int
    num_senders: int = 1
    num_workers: int = 1
    """The engine's vLLM workers (its tensor_parallel_size x pipeline_parallel_size)."""
    timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        return self.num_senders + self.num_workers

    def worker_init_info(self) -> dict:
        """The ``init_info`` of ``init_weight_transfer_engine`` (what ``GlooInitInfo`` parses)."""
        return dict(master_address=self.master_address, master_port=self.master_port, num_senders=self.num_senders,
                    world_size=self.world_size, timeout_s=self.timeout_s)


class GlooSender:
    """One trainer rank's end of the group (sender ``index`` of ``endpoint.num_senders``): streams
    buckets to every worker. Sender 0 hosts the store, so it must open while the workers join."""

    def __init__(self, endpoint: TransferEndpoint, index: int = 0):
        if not 0 <= index < endpoint.num_senders:
            raise ValueError(f"sender index {index} outside 0..{endpoint.num_senders - 1}")
        self.endpoint, self.index = endpoint, index
        self.workers = list(range(endpoint.num_senders, endpoint.world_size))
        self.pg = open_group(endpoint.master_address, endpoint.master_port, index, endpoint.world_size,
                             endpoint.timeout_s)
        self.bytes_sent = 0

    def send_buckets(self, buckets: Iterable[Bucket]) -> List[str]:
        """Sends every bucket, then END; returns the names sent. An error while producing the buckets
        (a failed gather) is sent as ABORT, so the workers stop waiting, and re-raised."""
        names: List[str] = []
        try:
            for bucket in buckets:
                if not bucket:
                    continue
                meta, payload = pack_bucket(bucket)
                send_message(self.pg, self.workers, BUCKET, meta, payload)
                self.bytes_sent += payload.numel() * len(self.workers)
                names.extend(name for name, _ in bucket)
        except BaseException as exc:
            try:  # the workers stop waiting for this sender (unless the wire itself broke)
                send_message(self.pg, self.workers, ABORT,
                             f"aborted by sender {self.index}: {type(exc).__name__}: {exc}".encode())
            except Exception:  # noqa: BLE001 - the original error is what matters
                pass
            raise
        send_message(self.pg, self.workers, END)
        return names

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort
                pass
            self.pg = None


def open_transfer(client, endpoint: TransferEndpoint) -> GlooSender:
    """Sender 0's handshake: ``client.init_weight_transfer_engine`` (the workers join the group inside it)
    runs on a side thread while this rank opens its end; both must meet. Other senders open
    ``GlooSender(endpoint, index)`` at the same time on their own ranks."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="wt-init") as pool:
        joined = pool.submit(client.init_weight_transfer_engine, endpoint.worker_init_info())
        sender = GlooSender(endpoint, 0)
        joined.result()
    return sender


def push_round(client, sender: GlooSender, buckets: Iterable[Bucket], version: int) -> List[str]:
    """One update round driven by sender 0: start, ``update_weights`` (on a side thread: the workers
    receive inside it) while the buckets go out, finish with our version. Other senders call
    ``sender.send_buckets`` concurrently on their ranks."""
    client.start_weight_update()
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="wt-update") as pool:
            received = pool.submit(client.update_weights, dict(version=int(version)))
            try:
                names = sender.send_buckets(buckets)
            finally:
                received.result()  # the workers' error (a refused name) wins over ours: it says more
    except BaseException:
        try:  # close the workers' layerwise reload (no new version): a half-open one leaves layers unusable
            client.finish_weight_update(None)
        except Exception:  # noqa: BLE001 - the round's error is the one to report
            pass
        raise
    client.finish_weight_update(str(version))
    return names


# ---- vLLM worker side ---------------------------------------------------------------------------------------


def receive_all(pg, num_senders: int, load) -> int:
    """Receives from senders 0 .. num_senders-1 at once (one thread each, so no sender waits on
    another's stage) and calls ``load(bucket)`` here, one bucket at a time, until every sender has
    sent END. Returns the number of tensors loaded; a sender's ABORT is raised naming it."""
    arrived: "queue.Queue" = queue.Queue(maxsize=2 * num_senders)

    def listen(src: int) -> None:
        while True:
            try:
                kind, meta, payload = recv_message(pg, src)
            except BaseException as exc:  # noqa: BLE001 - handed to the loading thread
                arrived.put((ABORT, f"receiving from sender {src} failed: {exc}".encode(), None))
                return
            arrived.put((kind, meta, payload))
            if kind != BUCKET:
                return

    threads = [threading.Thread(target=listen, args=(s,), daemon=True, name=f"wt-recv-{s}") for s in
               range(num_senders)]
    for t in threads:
        t.start()
    num_loaded, open_senders, failure = 0, num_senders, None
    while open_senders:
        kind, meta, payload = arrived.get()
        if kind == BUCKET and failure is None:
            try:  # an error here must not stop the receiving: a sender blocked in send would wait forever
                bucket = unpack_bucket(meta, payload)
                load(bucket)
                num_loaded += len(bucket)
            except Exception as exc:  # noqa: BLE001 - keep receiving (the senders must finish), then raise
                first = json.loads(meta).get("names", ["?"])[0] if meta else "?"
                failure = f"loading a bucket ({first} ...) failed: {type(exc).__name__}: {exc}"
        elif kind != BUCKET:
            open_senders -= 1
            if kind == ABORT and failure is None:
                failure = meta.decode(errors="replace")
    for t in threads:
        t.join()
    if failure is not None:
        raise RuntimeError(f"gloo weight transfer failed: {failure}")
    return num_loaded
