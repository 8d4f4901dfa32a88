"""vLLM's engine classes for the ``gloo`` weight-transfer backend (the wire is ``gloo_transfer.py``).

Imported by vLLM's ``WeightTransferEngineFactory`` / ``WeightTransferTrainerFactory`` when the
backend is chosen (``gloo_transfer.register`` registers this module lazily), so importing vLLM
here at the top costs nothing elsewhere.

- ``GlooWeightTransferEngine`` (in each vLLM worker): joins the group after the senders, receives
  every sender's buckets at once and loads them with vLLM's layerwise reload, as vLLM's nccl engine
  does (``initialize_layerwise_reload`` / ``model.load_weights`` / ``finalize_layerwise_reload``),
  then re-packs CPU fused-MoE experts. Delta pushes (``generation.delta_push``) arrive as patches:
  its ``DeltaReceiver`` turns them into full tensors before they load, as the file transport's
  worker extension does, so the loaded weights are a dense push's bit for bit.
- ``GlooTrainerWeightTransferEngine`` (trainer side, vLLM's ``TrainerWeightTransferEngine``
  interface over ``gloo_transfer.GlooSender``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_grpo.compat.vllm import begin_layerwise_reload, finish_layerwise_reload
from megatron_grpo.rollout.engines.vllm_worker import repack_moe
from megatron_grpo.rollout.transfer.delta import DeltaReceiver
from megatron_grpo.rollout.transfer.gloo_transfer import (
    BACKEND,
    Bucket,
    GlooSender,
    TransferEndpoint,
    open_group,
    open_transfer,
    push_round,
    receive_all,
)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Worker-side init info (``TransferEndpoint.worker_init_info``): the group's store and size;
    workers sit after the senders."""

    master_address: str
    master_port: int
    num_senders: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round: the trainer's weights version (the senders stream the buckets themselves)."""

    version: int = 0


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives every sender's buckets (concurrently) and loads them with layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.pg, self.num_senders, self.num_loaded = None, 0, 0
        self.delta = DeltaReceiver()
        """Host copies of the last full tensors while pushes are delta pushes (``delta.py``)."""

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a trainer that reconnects (after a failed push, or restarted) gets a new group
        self.delta = DeltaReceiver()  # and pushes a full version first: a patch now would name its base
        pc = self.parallel_config
        rank = init_info.num_senders + pc.data_parallel_index * pc.world_size + pc.rank
        self.num_senders = init_info.num_senders
        self.pg = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                             init_info.timeout_s)

    def start_weight_update(self) -> None:
        begin_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # vLLM's base class syncs unconditionally (fails on CPU)
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.pg is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        try:
            self.num_loaded = receive_all(self.pg, self.num_senders, self._load)
        except BaseException:
            self.delta = DeltaReceiver()  # a half-applied push is no base for the next patch
            raise

    def _load(self, bucket: Bucket) -> None:
        self.model.load_weights(self.delta.apply(bucket))

    def finish_weight_update(self) -> None:
        finish_layerwise_reload(self.model, self.model_config)
        repack_moe(self.model)

    def shutdown(self) -> None:
        if self.pg is not None:
            self.pg.shutdown()
            self.pg = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the gloo backend (``rank`` = this sender's index; 0 drives the client)."""

    backend = BACKEND
    master_address: str = "127.0.0.1"
    master_port: int = 0
    num_senders: int = 1
    num_workers: int = 1
    timeout_s: float = 600.0

    def endpoint(self) -> TransferEndpoint:
        return TransferEndpoint(self.master_address, self.master_port, self.num_senders, self.num_workers,
                                self.timeout_s)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """vLLM's trainer-engine interface over ``GlooSender``: every sender rank calls ``trainer_init``
    and ``send_weights``; sender 0 (``rank == 0``) also drives the client."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0)
        endpoint = init_info.endpoint()
        engine.sender = open_transfer(client, endpoint) if engine.is_sender else GlooSender(endpoint, init_info.rank)
        return engine

    def send_weights(self, buckets: Optional[Iterable[Bucket]] = None, version: int = 0) -> List[str]:
        """Sends ``buckets`` (default: the source as one bucket); sender 0 runs the whole round."""
        buckets = buckets if buckets is not None else [list(self.source)]
        if not self.is_sender:
            return self.sender.send_buckets(buckets)
        return push_round(self.client, self.sender, buckets, version)

    def shutdown(self) -> None:
        self.sender.close()
