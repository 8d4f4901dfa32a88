"""In-process generators for multi-rank push tests: each receives a push the way vLLM's workers do (the file
transport's worker extension: ``load_file`` + ``DeltaReceiver``; the gloo engine: ``receive_all`` +
``DeltaReceiver``) and keeps the tensors it would load, so a test compares them bit for bit. Both plan pushes
from every pipeline stage (``stage_push.StagePushEngine``), as the vLLM engines do."""

from __future__ import annotations

import contextlib
import os

import torch

from megatron_grpo.rollout.transfer import delta as D
from megatron_grpo.rollout.transfer.fanout import fan_out
from megatron_grpo.rollout.transfer.stage_push import StagePushEngine


class CapturingEngine:
    """An in-process engine stand-in keeping every pushed tensor (a one-process push: no transport)."""

    def __init__(self):
        self.weights = {}

    def update_weights(self, buckets, version):
        for bucket in buckets:
            self.weights.update({n: t.clone() for n, t in bucket})


class FileGenerator(StagePushEngine):
    """``generation.weight_transfer=file``: reads each bucket file (its link) and unlinks it."""

    weight_transfer, accepts_delta_push = "file", True

    def __init__(self):
        self.weights, self.receiver, self.policy_version, self.files = {}, D.DeltaReceiver(), -1, 0

    def update_weights(self, buckets, version):
        return fan_out(buckets, [self], version, stages=self.take_stage_files())

    def begin_weight_push(self):
        pass

    def push_file(self, path):
        from safetensors.torch import load_file

        tensors = load_file(path)
        os.unlink(path)
        self.weights.update({n: t.clone() for n, t in self.receiver.apply(list(tensors.items()))})
        self.files += 1

    def end_weight_push(self, version):
        self.policy_version = version


class _GlooClient:
    """vLLM's weight-sync control plane with one worker (a thread of this process) in the transfer group."""

    def __init__(self, owner):
        self.owner, self.pg, self.senders = owner, None, 0

    def init_weight_transfer_engine(self, info):
        from megatron_grpo.rollout.transfer.gloo_transfer import open_group

        self.senders = info["num_senders"]
        self.pg = open_group(info["master_address"], info["master_port"], self.senders, info["world_size"],
                             info["timeout_s"])

    def start_weight_update(self):
        pass

    def update_weights(self, info):
        from megatron_grpo.rollout.transfer.gloo_transfer import receive_all

        receive_all(self.pg, self.senders, lambda bucket: self.owner.weights.update(
            {n: t.clone() for n, t in self.owner.receiver.apply(bucket)}))

    def finish_weight_update(self, version):
        pass


class GlooGenerator(StagePushEngine):
    """``generation.weight_transfer=gloo`` through ``transport.VLLMTransfer`` (the trainer side under test)."""

    weight_transfer, accepts_delta_push, quantization = "gloo", True, None

    def __init__(self):
        from megatron_grpo.rollout.transfer.transport import VLLMTransfer

        self.weights, self.receiver, self.policy_version, self.pushed_digests = {}, D.DeltaReceiver(), -1, {}
        self.transfer = VLLMTransfer("gloo", _GlooClient(self), timeout_s=120)

    def update_weights(self, buckets, version):
        from megatron_grpo.rollout.transfer.transport import digesting

        self.pushed_digests = {}
        names = self.transfer.push(digesting(buckets, self.pushed_digests), version)
        self.policy_version = version
        return names

    def close(self):
        self.transfer.close()


@contextlib.contextmanager
def trainer_sends():
    """Tensor bytes this rank sends to other trainer ranks through ``torch.distributed`` (point-to-point and
    gathers) while the block runs: ``[(call, bytes)]``."""
    import torch.distributed as dist

    sent, originals = [], {n: getattr(dist, n) for n in ("send", "isend", "gather", "broadcast", "all_gather")}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor")
            if torch.is_tensor(tensor):
                sent.append((name, tensor.numel() * tensor.element_size()))
            return fn(*args, **kwargs)
        return wrapped

    for name, fn in originals.items():
        setattr(dist, name, spy(name, fn))
    try:
        yield sent
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
