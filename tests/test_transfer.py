"""vLLM weight-transfer API: our gloo wire (several senders into one receiver), transport selection,
the nccl / ipc request payloads through vLLM's trainer factory (fake engines), checksum checks,
and the /dev/shm free-space fallback of the file transport."""

import os
import socket
import threading
from collections import namedtuple

import pytest
import torch

from tests._fakes import OnFakeGPU

from megatron_grpo.rollout.transfer import fanout
from megatron_grpo.rollout.transfer.transport import resolve_transport


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _buckets(stage: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(stage)
    return [[(f"model.layers.{2 * stage + k}.mlp.down_proj.weight", torch.randn(3, 5, generator=gen).to(dtype)),
             (f"model.layers.{2 * stage + k}.input_layernorm.weight", torch.randn(5, generator=gen).to(dtype))]
            for k in range(2)]


def _run_group(num_senders, sender_fn, num_receivers=1, load=None):
    """Senders 0..S-1 and receivers S.. of one gloo transfer group, as threads; returns each receiver's
    (loaded tensors, error) and each sender's error. ``load(loaded, bucket)``: the receivers' loader."""
    pytest.importorskip("vllm")
    from megatron_grpo.rollout.transfer import gloo_transfer as gt

    endpoint = gt.TransferEndpoint("127.0.0.1", _port(), num_senders, num_receivers, timeout_s=60)
    out = {}

    def receiver(k):
        pg = gt.open_group("127.0.0.1", endpoint.master_port, num_senders + k, endpoint.world_size, 60)
        loaded = []
        try:
            gt.receive_all(pg, num_senders, loaded.extend if load is None else lambda b: load(loaded, b))
            out[("recv", k)] = (loaded, None)
        except Exception as exc:  # noqa: BLE001
            out[("recv", k)] = (loaded, exc)

    def sender(s):
        try:
            sender_fn(gt.GlooSender(endpoint, s), s)
            out[("send", s)] = None
        except Exception as exc:  # noqa: BLE001
            out[("send", s)] = exc

    threads = [threading.Thread(target=receiver, args=(k,)) for k in range(num_receivers)]
    threads += [threading.Thread(target=sender, args=(s,)) for s in range(num_senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "transfer group hung"
    return out


def test_two_pipeline_stage_senders_feed_one_receiver_and_an_abort_names_the_sender():
    """PP = 2: each stage's sender streams its own layers (bf16 and fp32 bytes exact) into the same
    receivers (2 of them, like vLLM TP = 2 workers); a failing gather on stage 1 reaches them as
    ABORT naming that sender; the receiver loads nothing more but drains stage 0 (no hang)."""
    out = _run_group(2, lambda snd, s: snd.send_buckets(_buckets(s, torch.bfloat16 if s else torch.float32)),
                     num_receivers=2)
    expected = {n: t for s in range(2) for b in _buckets(s, torch.bfloat16 if s else torch.float32) for n, t in b}
    for k in range(2):
        loaded, err = out[("recv", k)]
        assert err is None
        got = dict(loaded)
        assert sorted(got) == sorted(expected)
        assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in expected.items())

    def failing(snd, s):
        def gather():
            yield from _buckets(s)[:1]
            if s == 1:
                raise RuntimeError("gather failed on stage 1")
            yield from _buckets(s)[1:]
        snd.send_buckets(gather())

    out = _run_group(2, failing)
    loaded, err = out[("recv", 0)]
    assert isinstance(err, RuntimeError) and "aborted by sender 1" in str(err) and "gather failed" in str(err)
    assert {n for n, _ in loaded} <= {n for s in range(2) for b in _buckets(s) for n, _ in b}  # none after the abort
    assert out[("send", 0)] is None and "gather failed" in str(out[("send", 1)])  # stage 0 finished: drained


def test_unaligned_patch_entries_arrive_exact_and_a_failing_load_never_blocks_the_sender():
    """A delta patch packs int32 indices after an odd count of bf16 values (vLLM's packer does not align):
    they arrive bit for bit. A receiver whose load fails keeps draining: the sender finishes every bucket
    (before, the error escaped the receive loop and the sender blocked in send for good) and the error
    names the bucket."""
    patch = [("w::delta_value", torch.randn(3).bfloat16()), ("w::delta_index", torch.tensor([2, 9, 31], dtype=torch.int32)),
             ("w::delta_sha256", torch.arange(32, dtype=torch.uint8)), ("v", torch.randn(2, 3, dtype=torch.float64))]
    out = _run_group(1, lambda snd, s: snd.send_buckets([patch]))
    loaded, err = out[("recv", 0)]
    assert err is None and out[("send", 0)] is None
    assert all(got.dtype == t.dtype and torch.equal(got, t) for (_, t), (_, got) in zip(patch, loaded))

    def refuse_layer_0(loaded, bucket):
        if "layers.0" in bucket[0][0]:
            raise KeyError("no such parameter")
        loaded.extend(bucket)

    out = _run_group(1, lambda snd, s: snd.send_buckets(_buckets(0) * 3), load=refuse_layer_0)
    loaded, err = out[("recv", 0)]
    assert out[("send", 0)] is None  # every bucket went out: the receiver drained them
    assert isinstance(err, RuntimeError) and "model.layers.0.mlp.down_proj.weight" in str(err) and "KeyError" in str(err)
    assert loaded == []  # nothing loads after the first failure


class _RecordingGroup:
    """A gloo group that records what each ``send`` would hand to gloo's TCP transport."""

    def __init__(self):
        self.sent = []

    def send(self, tensors, dst, tag):
        self.sent.extend(tensors)
        return namedtuple("Work", "wait")(lambda: True)


def test_gloo_sends_buckets_of_cuda_tensors_from_host_memory(monkeypatch):
    """weight_transfer=gloo with buckets on the trainer's GPU (cuda=True): every buffer handed to
    gloo is a host tensor (gloo would otherwise read the device pointer as host memory), with the
    bucket's bytes."""
    pytest.importorskip("vllm")
    from megatron_grpo.rollout.transfer import gloo_transfer as gt

    assert resolve_transport("gloo", "vllm_server", colocated=False, cuda=True) == "gloo"
    group = _RecordingGroup()
    monkeypatch.setattr(gt, "open_group", lambda *args: group)
    bucket = [(name, t.as_subclass(OnFakeGPU)) for name, t in _buckets(0)[0]]
    assert all(t.is_cuda for _, t in bucket)
    gt.GlooSender(gt.TransferEndpoint("127.0.0.1", 1, num_workers=2)).send_buckets([bucket])
    assert len(group.sent) == 2 * 4  # per worker: header, meta, payload; then END's header
    assert [(type(t), t.device.type) for t in group.sent] == [(torch.Tensor, "cpu")] * len(group.sent)
    meta, payload = bytes(group.sent[1].numpy()), group.sent[2]
    got = dict(gt.unpack_bucket(meta, payload))
    assert all(torch.equal(got[name], t) for name, t in _buckets(0)[0])


def test_gloo_trainer_engine_through_vllms_factory_drives_the_client_in_order():
    """``register()`` (the entry point) puts gloo in both of vLLM's factories; the trainer engine from
    ``WeightTransferTrainerFactory.trainer_init`` does the handshake and one round per push: start,
    update (the worker receives inside it), finish with our version."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from megatron_grpo.rollout.transfer import gloo_transfer as gt
    from megatron_grpo.rollout.transfer.gloo_engine import GlooTrainerInitInfo

    gt.register()
    gt.register()  # idempotent: vLLM may load plugins more than once
    assert WeightTransferEngineFactory._registry["gloo"]().__name__ == "GlooWeightTransferEngine"

    class WorkerSide:  # what vLLM's worker does behind the client's calls
        def __init__(self):
            self.calls, self.loaded, self.pg = [], [], None

        def init_weight_transfer_engine(self, info):
            self.calls.append(("init", info["world_size"], info["num_senders"]))
            self.pg = gt.open_group(info["master_address"], info["master_port"], info["num_senders"],
                                    info["world_size"], info["timeout_s"])

        def start_weight_update(self):
            self.calls.append(("start",))

        def update_weights(self, info):
            self.calls.append(("update", info["version"]))
            gt.receive_all(self.pg, 1, self.loaded.extend)

        def finish_weight_update(self, version=None):
            self.calls.append(("finish", version))

    worker = WorkerSide()
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=_port(), num_senders=1, num_workers=1,
                                  timeout_s=60, rank=0)
    def failing_gather():
        yield _buckets(0)[0]
        raise RuntimeError("gather failed")

    engine = WeightTransferTrainerFactory.trainer_init(info, client=worker)
    try:
        assert engine.send_weights(_buckets(0), version=7) == [n for b in _buckets(0) for n, _ in b]
        with pytest.raises(RuntimeError, match="aborted by sender 0: RuntimeError: gather failed"):
            engine.send_weights(failing_gather(), version=8)  # the worker's ABORT error wins: it names the sender
    finally:
        engine.shutdown()
    assert worker.calls == [("init", 2, 1), ("start",), ("update", 7), ("finish", "7"),
                            ("start",), ("update", 8), ("finish", None)]  # the reload closed, version 8 not claimed
    assert all(torch.equal(t, dict(worker.loaded)[n]) for b in _buckets(0) for n, t in b)


def test_transport_selection_and_config_validation():
    from megatron_grpo.config.schema import GenerationConfig

    assert resolve_transport("auto", "vllm", colocated=True, cuda=False) == "file"
    assert resolve_transport("auto", "vllm_server", colocated=False, cuda=False) == "gloo"
    assert resolve_transport("auto", "vllm_server", colocated=False, cuda=True) == "nccl"
    assert resolve_transport("auto", "vllm_server", colocated=True, cuda=True) == "ipc"
    for layout in (dict(trainer_ranks=2), dict(num_engines=2), dict(tensor_parallel_size=2)):
        assert resolve_transport("auto", "vllm_server", colocated=True, cuda=True, **layout) == "file"
        with pytest.raises(ValueError, match="generation.weight_transfer=ipc needs one trainer rank"):
            resolve_transport("ipc", "vllm_server", colocated=True, cuda=True, **layout)
    assert resolve_transport("gloo", "vllm", colocated=True, cuda=False) == "gloo"
    with pytest.raises(ValueError, match="generation.weight_transfer=nccl needs CUDA"):
        resolve_transport("nccl", "vllm_server", colocated=False, cuda=False)
    with pytest.raises(ValueError, match="generation.weight_transfer: unknown 'tcp'"):
        GenerationConfig(weight_transfer="tcp")
    with pytest.raises(ValueError, match="generation.weight_transfer=ipc .* colocated"):
        GenerationConfig(backend="vllm_server", server_url="http://h:1", weight_transfer="ipc")
    with pytest.raises(ValueError, match="generation.weight_transfer=nccl with generation.colocated=true"):
        GenerationConfig(weight_transfer="nccl", colocated=True)
    with pytest.raises(ValueError, match="generation.weight_transfer=gloo with generation.backend=megatron"):
        GenerationConfig(backend="megatron", weight_transfer="gloo")


class _RecordingServer:
    """``VLLMServerEngine._post`` stand-in: records (path, body) and answers the RL routes; the server runs
    ``world_size`` vLLM workers (``/get_world_size``), whatever the trainer's config says."""

    def __init__(self, world_size=2):
        self.calls, self.world_size = [], world_size

    def __call__(self, path, body, retry=True):
        self.calls.append((path, body))
        if path == "/weight_info":
            return {"weight_version": "3"}
        if path == "/get_world_size":
            return {"world_size": self.world_size}
        return {}


def _server_engine(monkeypatch, backend, recorder):
    from megatron_grpo.rollout.engines.vllm_server import VLLMServerEngine

    monkeypatch.setattr(VLLMServerEngine, "_wait_healthy", lambda self, timeout_s: None)
    monkeypatch.setattr(VLLMServerEngine, "_post", lambda self, path, body, retry=True: recorder(path, body))
    return VLLMServerEngine("/m", torch.bfloat16, url="http://10.0.0.7:8000", weight_transfer=backend,
                            transfer_address="10.0.0.1", tensor_parallel_size=2)


def test_nccl_push_runs_vllms_own_trainer_engine_with_the_servers_worker_count(monkeypatch):
    """vLLM's real ``NCCLTrainerWeightTransferEngine`` on CPU: only its two CUDA calls are replaced (the NCCL
    endpoint: a recording group; the packed broadcast: the same ``pack_tensors`` chunks, sent at once). The
    remote server runs 4 workers though the trainer's config says TP 2: the group is 1 + 4. The first push
    is a round per bucket (metadata learnt), the second one round that vLLM checks against the declared
    metadata, and the broadcast bytes unpack to the pushed tensors. A stream that no longer matches the
    metadata fails the push (vLLM names the tensor) and the next push learns the metadata again."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer import nccl_engine
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    groups = []

    class Group:
        def __init__(self, info):
            self.info, self.chunks = info, []

        def broadcast(self, tensor, src):
            self.chunks.append(tensor.clone())

        def destroy(self):
            pass

    def producer(iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        while (chunk := pack_tensors(iterator, post_iter_func, buffer_size_bytes)) is not None:
            group.broadcast(chunk.packed_tensor, src=src)

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info, rank=0: groups.append(Group(info)) or groups[-1])
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", producer)
    recorder = _RecordingServer(world_size=4)
    engine = _server_engine(monkeypatch, "nccl", recorder)
    buckets = _buckets(0, torch.bfloat16)
    names = [n for b in buckets for n, _ in b]
    assert engine.update_weights(iter(buckets), 3) == names
    newer = [[(n, t * 2) for n, t in b] for b in buckets]
    recorder.calls.clear()
    assert engine.update_weights(iter(newer), 4) == names
    (group,) = groups
    assert (group.info.master_address, group.info.world_size) == ("10.0.0.1", 5)
    paths = [p for p, _ in recorder.calls]
    assert paths == ["/pause?mode=wait", "/start_weight_update", "/update_weights", "/finish_weight_update",
                     "/update_weight_version", "/resume"]  # one round for the whole second push
    info = recorder.calls[2][1]["update_info"]
    assert info["names"] == names and info["dtype_names"] == ["bfloat16"] * 4
    sizes = [t.numel() * t.element_size() for b in newer for _, t in b]
    received = unpack_tensor(group.chunks[-1], info["names"], info["shapes"], [torch.bfloat16] * 4, sizes)
    assert all(torch.equal(got, t) for (_, got), (_, t) in zip(received, [x for b in newer for x in b]))
    assert engine.policy_version == 4 and engine.transfer.bytes_sent == 2 * sum(sizes)
    wrong = [[(n, t[..., :2] if "down_proj" in n else t) for n, t in b] for b in buckets]
    with pytest.raises(ValueError, match="metadata\\(\\) disagrees with iteration at index 0"):
        engine.update_weights(iter(wrong), 5)
    assert engine.policy_version == -1 and len(groups) == 1
    assert engine.update_weights(iter(wrong), 5) == names and len(groups) == 2  # reopened, metadata learnt again
    engine._proc = None
    engine.close()


def test_ipc_goes_through_vllms_trainer_factory_packed_one_round_after_the_first(monkeypatch, tmp_path):
    """ipc (CUDA IPC handles; its engine needs a GPU, a fake stands in, registered in vLLM's factory): packed
    init info (bounded buffers), a round per bucket on the first push and one round after, the version set
    between the rounds and /resume; the launched server gets the env var vLLM requires for pickled handles."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    made = []

    class FakeTrainerEngine:
        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            engine = cls()
            engine.init_info, engine.client, engine.sent = init_info, client, []
            client.init_weight_transfer_engine({"packed": init_info.packed})
            made.append(engine)
            return engine

        def send_weights(self):  # what vLLM's engines do each round
            self.client.start_weight_update()
            meta = self.source.metadata()
            self.client.update_weights({"names": [m.name for m in meta], "shapes": [list(m.shape) for m in meta]})
            self.sent.append([n for n, _ in self.source])
            self.client.finish_weight_update()

        def shutdown(self):
            pass

    monkeypatch.setitem(WeightTransferTrainerFactory._registry, "ipc", lambda: FakeTrainerEngine)
    recorder = _RecordingServer()
    engine = _server_engine(monkeypatch, "ipc", recorder)
    buckets = _buckets(0)
    names = [n for b in buckets for n, _ in b]
    assert engine.update_weights(iter(buckets), 3) == names
    engine.update_weights(iter(buckets), 4)  # the handshake happens once
    assert len(made) == 1 and made[0].init_info.packed and made[0].sent == [names[:2], names[2:], names]
    paths = [p for p, _ in recorder.calls if p != "/get_world_size"]
    per_round = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert paths == ["/pause?mode=wait", "/init_weight_transfer_engine"] + per_round * 2 + [
        "/update_weight_version", "/resume", "/pause?mode=wait"] + per_round + ["/update_weight_version", "/resume"]
    assert engine.policy_version == 4 and set(engine.pushed_digests) == set(names)
    launched = {}
    monkeypatch.setattr("subprocess.Popen", lambda cmd, env, **kw: launched.update(env) or
                        type("P", (), {"pid": 1, "poll": lambda self: None})())
    engine._launch(1, 64, 0, 1, 0.5, str(tmp_path / "server.log"))
    assert launched["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    engine._proc = None
    engine.close()


def test_checksums_compare_the_tensors_vllm_keeps_and_name_the_engine_and_tensor():
    from megatron_grpo.rollout.parity import ParityError, check_weights
    from megatron_grpo.rollout.transfer.transport import EMPTY_DIGEST, compare_checksums, trainer_digests

    norm, emb = torch.randn(8), torch.randn(4, 8)
    ours = trainer_digests([("model.norm.weight", norm), ("model.embed_tokens.weight", emb),
                            ("model.layers.0.mlp.down_proj.weight", torch.randn(8, 8))])
    engine_side = {"dp0:pp0:pcp0:tp0:model.norm.weight": ours["model.norm.weight"],
                   "dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight": EMPTY_DIGEST,  # repacked by the CPU kernel
                   "dp0:pp0:pcp0:tp0:model.embed_tokens.weight": "0" * 64,  # sharded over vLLM TP: skipped
                   "dp0:pp0:pcp0:tp1:model.embed_tokens.weight": "1" * 64}
    assert compare_checksums(engine_side, ours) == (1, None)
    engine_side["dp0:pp0:pcp0:tp1:model.norm.weight"] = ours["model.norm.weight"]  # vLLM TP 2: replicated norm
    assert compare_checksums(engine_side, ours) == (1, None)  # still compared (it used to be skipped as "sharded")
    engine_side["dp0:pp0:pcp0:tp1:model.norm.weight"] = "e" * 64  # TP rank 1 kept a stale norm
    assert compare_checksums(engine_side, ours) == (1, "model.norm.weight")
    engine_side["dp0:pp0:pcp0:tp1:model.norm.weight"] = engine_side["dp0:pp0:pcp0:tp0:model.norm.weight"] = "f" * 64
    assert compare_checksums(engine_side, ours) == (1, "model.norm.weight")

    class Engine:
        def __init__(self, digests, version="5"):
            self.pushed_digests, self.digests, self.version = ours, digests, version

        def weight_version(self):
            return self.version

        def weight_checksums(self):
            return self.digests

    class Pool:
        def __init__(self, engines):
            self.engines = engines

        def name(self, i):
            return f"engine {i} of {len(self.engines)}"

    good = {"dp0:pp0:pcp0:tp0:model.norm.weight": ours["model.norm.weight"]}
    assert check_weights(Pool([Engine(good), Engine(good)]), 5) == 2
    with pytest.raises(ParityError, match=r"engine 1 of 2: checksum of model.norm.weight .* version 5 differs"):
        check_weights(Pool([Engine(good), Engine(engine_side)]), 5)
    with pytest.raises(ParityError, match=r"engine 0 of 1 reports weights version '4' after the push of version 5"):
        check_weights(Pool([Engine(good, version="4")]), 5)


StatVFS = namedtuple("StatVFS", "f_bavail f_frsize")


def test_bucket_files_fall_back_to_disk_when_dev_shm_is_full(tmp_path, monkeypatch, caplog):
    """Docker's 64 MiB /dev/shm: a push that needs more (bucket x max_in_flight) goes to the temp dir
    on disk with one warning; when neither has room the error names both folders and sizes."""
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir(), disk.mkdir()
    free = {str(shm): 1000, str(disk): 10 * 2**20}
    real = os.statvfs
    monkeypatch.setattr(fanout.os, "statvfs", lambda p: StatVFS(free[str(p)], 1) if str(p) in free else real(p))
    monkeypatch.setattr(fanout.tempfile, "gettempdir", lambda: str(disk))
    bucket = [("w", torch.ones(1000))]  # 4000 bytes: does not fit 1000 bytes of "shm"
    out = fanout.SharedFileFanout(2, folder=str(shm))
    with caplog.at_level("WARNING", logger="megatron_grpo.rollout.transfer.fanout"):
        paths = out.publish(bucket) + out.publish(bucket)
    assert all(p.startswith(str(disk)) for p in paths) and os.listdir(shm) == []
    assert sum("has 0.0 MiB free" in r.getMessage() for r in caplog.records) == 1
    out.close()
    free[str(shm)] = 4 * 2**20  # room: /dev/shm it is
    out = fanout.SharedFileFanout(1, folder=str(shm))
    assert out.publish(bucket)[0].startswith(str(shm))
    out.close()
    free[str(shm)], free[str(disk)] = 1000, 2000
    with pytest.raises(RuntimeError, match=rf"{shm} has 0.0 MiB free and {disk} 0.0 MiB, the push needs 2.0 MiB"):
        fanout.SharedFileFanout(1, folder=str(shm)).publish(bucket)
