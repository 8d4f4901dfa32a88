"""The push from every pipeline stage: each stage's leader sends its own layers to the generator(s).

At PP > 1 rank 0, which drives the engines, makes a ``StagePlan`` for each push (``plan_push``) and every
rank receives it (one small broadcast in ``weight_sync.push_weights``); each stage's leader then streams its
own stage's buckets (``weight_sync.hf_buckets(per_stage=True)``) to every engine at the same time as rank 0
streams stage 0's. No rank holds another stage's tensors, and nothing crosses between trainer ranks but the
plan and, after the push, each leader's report (names, bytes, checksums, error):

- ``file``: one folder per push. Stage s's leader writes its k-th bucket as ``s<s>-<k>.safetensors``,
  hard-linked once per engine (``fanout.SharedFileFanout``, at most ``max_in_flight`` unread), then marks it
  ``s<s>-<k>.ready``; ``s<s>.end`` closes its part (the count and its error). Rank 0's ``fanout.fan_out``
  hands every stage's files to every engine as they become ready (``StageFiles.collect``), beside its own.
  Same host only, as the file transport always is: with stage leaders on other nodes the push goes through
  rank 0 (a warning says so).
- ``gloo``: each engine's transfer group has one sender per stage (``gloo_transfer.GlooSender(endpoint,
  stage)``, opened with rank 0's on the first push and again whenever rank 0 re-opens); rank 0 drives the
  round, the workers receive from every sender at once (``gloo_transfer.receive_all``).
- vLLM's ``nccl`` engine broadcasts from one trainer rank (rank 0 of its NCCL group, the workers at
  ``rank_offset`` 1) and ``ipc`` takes one trainer rank: no plan; stages > 0 forward their tensors to rank 0
  (``weight_sync.hf_tensors_on_rank0``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_grpo.models.fp8_hf import engine_keeps_bytes
from megatron_grpo.parallel.net import is_loopback, node_address
from megatron_grpo.rollout.transfer.fanout import SAFETENSORS_HEADER_SLACK, SharedFileFanout, fan_out_streams, pick_folder
from megatron_grpo.rollout.transfer.gloo_transfer import GlooSender, TransferEndpoint
from megatron_grpo.rollout.transfer.transport import digesting

logger = logging.getLogger(__name__)

_WARNED = set()


@dataclass
class StagePlan:
    """What the stage leaders need for one push (made on rank 0, sent to every rank)."""

    transport: str
    """``file`` or ``gloo``."""
    version: int
    num_stages: int
    patches: bool = False
    """Every target engine applies delta patches (``delta.py``): a delta push may send them."""
    folder: Optional[str] = None
    """file: this push's folder."""
    readers: int = 0
    """file: the engines that read each file (one hard link each)."""
    max_in_flight: int = 2
    """file: unread buckets a stage leader may have published at a time."""
    endpoints: Tuple[Tuple[int, TransferEndpoint, bool], ...] = ()
    """gloo: (engine index, its transfer group, whether rank 0 opens the group in this push) per engine."""
    quantization: Optional[dict] = None
    """gloo, fp8 generation: the engines' ``quantization_config`` (which checksums vLLM can match)."""


def plan_push(engines: Sequence, keys: Sequence[int], version: int, num_stages: int, *, same_host: bool = True,
              bucket_bytes: int = 0, max_in_flight: int = 2) -> Optional[StagePlan]:
    """Rank 0: the plan of a push from every stage to ``engines`` (pool indices ``keys``), or None where the stages
    go through rank 0 (vLLM's nccl / ipc engines; files with stage leaders on another host; ``num_stages`` 1).
    ``same_host``: every stage leader runs on rank 0's node; ``bucket_bytes``: the push's bucket size (the file
    folder must hold ``max_in_flight`` of them per stage). gloo: each transfer gets one sender per stage
    (re-opened if it had another count)."""
    if num_stages == 1:  # rank 0 alone sends: a gloo transfer opened for several senders opens again for one
        for transfer in (getattr(e, "transfer", None) for e in engines):
            if transfer is not None and transfer.backend == "gloo":
                transfer.set_senders(1)
        return None
    kinds = {getattr(e, "weight_transfer", None) for e in engines}
    if len(kinds) != 1 or not engines:
        return None
    kind, patches = kinds.pop(), all(bool(getattr(e, "accepts_delta_push", False)) for e in engines)
    if kind == "file":
        if not same_host:
            _warn_once("generation.weight_transfer=file: pipeline stage leaders on other nodes cannot write files "
                       "the engines read (same host only); their layers go through rank 0. Use gloo (or nccl) to "
                       "push from every stage")
            return None
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        root = pick_folder(root, (bucket_bytes + SAFETENSORS_HEADER_SLACK) * max_in_flight * num_stages)
        return StagePlan("file", version, num_stages, patches, folder=tempfile.mkdtemp(prefix="megatron-grpo-push-",
                                                                                         dir=root),
                         readers=len(engines), max_in_flight=max_in_flight)
    if kind != "gloo":
        return None
    endpoints = []
    for key, engine in zip(keys, engines):
        transfer = engine.transfer
        transfer.set_senders(num_stages)
        if not same_host and is_loopback(transfer.endpoint.master_address):
            transfer.set_address(_reachable_address())
        endpoints.append((key, dataclasses.replace(transfer.endpoint), not transfer.opened))
    return StagePlan("gloo", version, num_stages, patches, endpoints=tuple(endpoints),
                     quantization=getattr(engines[0], "quantization", None))


def _reachable_address() -> str:
    address = node_address()
    if address is None:
        raise ValueError("generation.weight_transfer_address: pipeline stage leaders on other nodes must reach rank "
                         "0's transfer group, but it listens on loopback and this node has no address they reach "
                         "(no GLOO_SOCKET_IFNAME, no default route): set generation.weight_transfer_address")
    return address


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


# ---- file: stage leaders write, rank 0 hands out ------------------------------------------------------------


def bucket_name(stage: int, k: int) -> str:
    return f"s{stage:03d}-{k:06d}.safetensors"


def reader_path(base: str, reader: int) -> str:
    """Engine ``reader``'s link of bucket file ``base`` (``fanout.SharedFileFanout``'s names)."""
    return base if reader == 0 else f"{base}.{reader}"


def _ready_path(folder: str, stage: int, k: int) -> str:
    return os.path.join(folder, f"s{stage:03d}-{k:06d}.ready")


def _end_path(folder: str, stage: int) -> str:
    return os.path.join(folder, f"s{stage:03d}.end")


def _touch(path: str, text: str = "") -> None:
    """Writes ``path`` whole or not at all (a rename): rank 0 polls for it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def publish_stage(plan: StagePlan, stage: int, buckets) -> Optional[str]:
    """A stage leader's file push: each bucket a file of the push's folder, linked once per engine, then marked
    ready; at the end ``s<stage>.end`` (count, error). Every bucket is drawn whatever fails (the gathers behind
    them are collective). Returns the error or None."""
    fanout = SharedFileFanout(plan.readers, folder=plan.folder, max_in_flight=plan.max_in_flight)
    count, error = 0, None
    try:
        for bucket in buckets:
            fanout.wait_for_room(lambda r: True)  # rank 0 removes the links of engines that stopped reading
            fanout.publish(bucket, name=bucket_name(stage, count))
            _touch(_ready_path(plan.folder, stage, count))
            count += 1
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which ends the push on every engine
        error = f"{type(exc).__name__}: {exc}"
        for _ in buckets:
            pass
    _touch(_end_path(plan.folder, stage), json.dumps(dict(count=count, error=error)))
    return error


class StageFiles:
    """Rank 0's side of a file push from every stage: the files stage leaders 1 .. S-1 publish in ``folder``."""

    def __init__(self, folder: str, num_stages: int, readers: int, poll_s: float = 0.002, timeout_s: float = 600.0):
        self.folder, self.stages, self.readers = folder, range(1, num_stages), readers
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self._handed: List[Tuple[int, str]] = []

    @classmethod
    def of(cls, plan: Optional[StagePlan]) -> Optional["StageFiles"]:
        if plan is None or plan.transport != "file":
            return None
        return cls(plan.folder, plan.num_stages, plan.readers)

    def collect(self, dispatch: Callable[[int, str], None], reading: Callable[[int], bool]) -> Optional[str]:
        """Hands each stage's files, in its order, to ``dispatch(reader, path)`` as they become ready, until every
        stage has ended; the links of readers that stopped (``reading(r)`` false) are removed instead, so the
        leaders never wait for them. Returns the first stage's error (or a timeout: no file for ``timeout_s``),
        else None."""
        nxt, ends, idle = dict.fromkeys(self.stages, 0), {}, time.monotonic()
        while True:
            moved = False
            for s in self.stages:
                while os.path.exists(ready := _ready_path(self.folder, s, nxt[s])):
                    base = os.path.join(self.folder, bucket_name(s, nxt[s]))
                    for r in range(self.readers):
                        self._hand(r, reader_path(base, r), dispatch, reading)
                    os.unlink(ready)
                    nxt[s], moved = nxt[s] + 1, True
                if s not in ends and os.path.exists(_end_path(self.folder, s)):
                    with open(_end_path(self.folder, s)) as f:
                        ends[s], moved = json.load(f), True
            for r in range(self.readers):
                if not reading(r):
                    self.abandon(r)
            if len(ends) == len(self.stages) and all(nxt[s] >= ends[s]["count"] for s in self.stages):
                break
            if moved:
                idle = time.monotonic()
            elif time.monotonic() - idle > self.timeout_s:
                late = [s for s in self.stages if s not in ends]
                return f"pipeline stage(s) {late} sent no bucket file for {self.timeout_s:.0f} s"
            else:
                time.sleep(self.poll_s)
        failed = [f"pipeline stage {s}: {ends[s]['error']}" for s in self.stages if ends[s].get("error")]
        return failed[0] if failed else None

    def _hand(self, reader: int, path: str, dispatch, reading) -> None:
        if reading(reader):
            self._handed.append((reader, path))
            dispatch(reader, path)
        else:
            _unlink(path)

    def drain(self) -> Optional[str]:
        """Frees every stage's files unread (rank 0's engine never took them: its push failed before), so the
        leaders finish; returns ``collect``'s error."""
        try:
            return self.collect(lambda r, path: _unlink(path), lambda r: False)
        finally:
            self.close()

    def abandon(self, reader: int) -> None:
        """Removes the links handed to engine ``reader`` (it died, or stopped reading after an error)."""
        kept = []
        for r, path in self._handed:
            if r == reader:
                _unlink(path)
            else:
                kept.append((r, path))
        self._handed = kept

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- gloo: a stage leader's senders --------------------------------------------------------------------------


class GlooStageSenders:
    """A stage leader's end of every engine's gloo transfer group (sender ``stage`` of each), kept across pushes:
    re-opened when rank 0 opens its own (first push, after a failure, a restarted engine)."""

    def __init__(self):
        self.open: Dict[int, GlooSender] = {}

    def send(self, plan: StagePlan, stage: int, buckets) -> List[str]:
        """Streams ``buckets`` to every engine of ``plan`` at once (one thread each); the first error is raised
        after all buckets are drawn."""
        for key, endpoint, fresh in plan.endpoints:
            sender = self.open.get(key)
            if sender is not None and (fresh or sender.endpoint != endpoint):
                self.drop(key)
        streams = [_SenderStream(self, key, endpoint, stage) for key, endpoint, _ in plan.endpoints]
        return fan_out_streams(buckets, streams, plan.version)

    def drop(self, key: int) -> None:
        sender = self.open.pop(key, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        for key in list(self.open):
            self.drop(key)


class _SenderStream:
    """One engine seen from a stage leader: ``update_weights`` as ``fanout.fan_out_streams`` calls it."""

    def __init__(self, owner: GlooStageSenders, key: int, endpoint: TransferEndpoint, stage: int):
        self.owner, self.key, self.endpoint, self.stage = owner, key, endpoint, stage

    def update_weights(self, stream, version: int) -> List[str]:
        sender = self.owner.open.get(self.key)
        if sender is None:  # joins while rank 0 opens (the workers join in init_weight_transfer_engine)
            sender = self.owner.open[self.key] = GlooSender(self.endpoint, self.stage)
        try:
            return sender.send_buckets(stream)
        except BaseException:
            self.owner.drop(self.key)  # rank 0 re-opens after a failed round: a new group next push
            raise


STAGE_SENDERS = GlooStageSenders()
"""This process's gloo senders (a stage leader's; one trainer per process)."""


def send_stage(plan: StagePlan, stage: int, buckets) -> dict:
    """A stage leader's part of a push (``stage`` > 0): its buckets to every engine of ``plan``. Returns what rank 0
    merges into the push's report besides the names and bytes: the checksums of small tensors (gloo: vLLM keeps
    them as sent; ``transport.digesting``) and the error (a string) or None."""
    digests: dict = {}
    if plan.transport == "file":
        return dict(digests=digests, error=publish_stage(plan, stage, buckets))
    q = plan.quantization
    keep = None if q is None else (lambda name, tensor: engine_keeps_bytes(name, tensor, q))
    try:
        STAGE_SENDERS.send(plan, stage, digesting(buckets, digests, keep))
        error = None
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it (the buckets were all drawn)
        error = f"{type(exc).__name__}: {exc}"
    return dict(digests=digests, error=error)


class StagePushEngine:
    """What a vLLM engine adds for pushes from every stage (rank 0; ``rollout/pool.py``'s pool has its own): the
    plan of the next push, its stage files for ``fanout.fan_out``, the stage leaders' checksums."""

    _stage_files: Optional[StageFiles] = None

    def stage_plan(self, version: int, num_stages: int, **options) -> Optional[StagePlan]:
        """The plan of the push of ``version`` (``plan_push``'s options), kept for ``update_weights``."""
        plan = plan_push([self], [0], version, num_stages, **options)
        self._stage_files = StageFiles.of(plan)
        return plan

    def take_stage_files(self) -> Optional[StageFiles]:
        files, self._stage_files = self._stage_files, None
        return files

    def add_stage_digests(self, digests: dict) -> None:
        """The stage leaders' checksums of what they sent (the parity probe compares vLLM's with all of them)."""
        if getattr(self, "transfer", None) is not None:
            self.pushed_digests.update(digests)
