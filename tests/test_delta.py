"""Delta weight push (``rollout/transfer/delta.py``): patches round-trip bit for bit, the full-push
schedule, the fallback to dense, the checksums a patch carries, the recipe keys."""

import hashlib

import pytest
import torch

from megatron_grpo.rollout.transfer import delta as D
from megatron_grpo.rollout.transfer.transport import digesting, trainer_digests


def _push(state: D.DeltaState, receiver: D.DeltaReceiver, tensors: dict) -> tuple:
    """One push of ``tensors`` (one rank: the shard is the tensor): (full tensors the engine loads, bytes sent)."""
    state.start()
    bucket = []
    for name, t in tensors.items():
        mask = state.changed(name, t.clone())
        entries = [(name, t)] if mask is None else D.encode(name, t, mask, 1 << 20)[0]
        bucket.extend(entries)
    state.finish()
    sent = D.entry_bytes(bucket)
    digests = {}
    list(digesting([bucket + [D.mark()]], digests))
    loaded = dict(receiver.apply(bucket + [D.mark()]))
    return loaded, sent, digests


def test_patches_rebuild_every_tensor_bit_for_bit_and_cost_less():
    gen = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(64, 32, generator=gen), "b": torch.randn(4096, generator=gen)}
    state, receiver = D.DeltaState(full_every=0), D.DeltaReceiver()
    loaded, dense_bytes, _ = _push(state, receiver, {k: v.to(torch.bfloat16) for k, v in w.items()})
    for step in range(5):
        w["a"][::7] += 1e-2  # a seventh of the rows move in bf16
        w["b"] += torch.randn(4096, generator=gen) * (1e-6 if step % 2 else 1.0)  # dense change: sent dense
        cast = {k: v.to(torch.bfloat16) for k, v in w.items()}
        loaded, sent, digests = _push(state, receiver, cast)
        for k in cast:
            assert torch.equal(loaded[k].view(torch.int16), cast[k].view(torch.int16))
        assert digests == trainer_digests(cast.items())  # checksums as a dense push records them
        assert sent < dense_bytes
    assert not state.full


def test_patch_larger_than_dense_is_sent_dense():
    t = torch.arange(10, dtype=torch.bfloat16)
    entries, patched = D.encode("w", t, torch.ones(10, dtype=torch.uint8), 0)
    assert not patched and entries == [("w", t)]
    entries, patched = D.encode("w", t, (torch.arange(10) < 2).to(torch.uint8), 0)
    assert patched and [n for n, _ in entries] == ["w" + D.INDEX, "w" + D.VALUE]
    assert entries[0][1].dtype == torch.int32 and entries[0][1].tolist() == [0, 1]


def test_full_push_first_after_restart_and_every_k():
    state = D.DeltaState(full_every=3)
    fulls = []
    for i in range(8):
        if i == 5:
            state.force_full = True  # an engine restarted
        fulls.append(state.start())
        state.finish()
    assert fulls == [True, False, False, True, False, True, False, False]


def test_patch_without_a_base_names_the_tensor():
    receiver = D.DeltaReceiver()
    t = torch.zeros(4, dtype=torch.bfloat16)
    bucket = D.encode("w", t, torch.tensor([1, 0, 0, 0], dtype=torch.uint8), 0)[0] + [D.mark()]
    with pytest.raises(RuntimeError, match="patch of w"):
        receiver.apply(bucket)
    plain = [("w", t)]
    assert receiver.apply(plain) is plain and not receiver.base  # delta push off: nothing kept


def test_sha_entry_is_the_full_tensors_digest():
    t = torch.randn(100).to(torch.bfloat16)
    entries, _ = D.encode("w", t, (torch.arange(100) == 3).to(torch.uint8), 1 << 20)
    sha = dict(entries)["w" + D.SHA256]
    assert bytes(sha.numpy()).hex() == hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest()


def test_recipe_keys_are_validated():
    from megatron_grpo.config.generation import GenerationConfig

    with pytest.raises(ValueError, match="generation.delta_full_every"):
        GenerationConfig(delta_push=True, delta_full_every=-1)
    with pytest.raises(ValueError, match="generation.delta_push"):
        GenerationConfig(delta_push=True, backend="megatron")
    with pytest.raises(ValueError, match="generation.delta_push"):
        GenerationConfig(delta_push=True, backend="vllm_server", weight_transfer="nccl", colocated=False)
    assert GenerationConfig(delta_push=True, weight_transfer="gloo").delta_push  # our gloo engine applies patches
    assert GenerationConfig(delta_push=True, weight_transfer="file").delta_full_every == 20


class _Receiver:
    """An engine stand-in: applies every bucket with a ``DeltaReceiver`` and keeps the full tensors."""

    accepts_delta_push = True

    def __init__(self):
        self.receiver, self.weights = D.DeltaReceiver(), {}

    def update_weights(self, buckets, version):
        for bucket in buckets:
            self.weights.update({n: t.clone() for n, t in self.receiver.apply(bucket)})


def _tp_worker(model_dir, layout):
    """Every rank perturbs a few elements of its shard and pushes with its own ``DeltaState`` (masks gathered
    over TP / EP); rank 0's receiver must hold exactly the dense push's tensors after every push."""
    import os

    from megatron_grpo.models import build_from_hf
    from megatron_grpo.parallel import state
    from megatron_grpo.rollout.transfer.weight_sync import hf_tensors_on_rank0, push_weights

    state.initialize_model_parallel(state.Layout(world_size=int(os.environ["WORLD_SIZE"]), **layout))
    model, shape = build_from_hf(model_dir)
    engine = _Receiver() if int(os.environ["RANK"]) == 0 else None
    delta, gen, out = D.DeltaState(full_every=0), torch.Generator().manual_seed(1), []
    for version in range(4):
        with torch.no_grad():
            for p in model.parameters():  # same draws on every rank: replicated params stay equal
                p.view(-1)[torch.randint(p.numel(), (3,), generator=gen)] += 0.1
        report = push_weights(model, shape, engine, version, dtype=torch.bfloat16, bucket_mb=0.25, delta=delta)
        dense = {n: t.clone() for n, t in hf_tensors_on_rank0(model, shape, torch.bfloat16)}
        if engine is not None:
            same = sorted(dense) == sorted(engine.weights) and all(
                torch.equal(dense[n].view(torch.int16), engine.weights[n].view(torch.int16)) for n in dense)
            out.append((report.full, same, report.num_bytes, report.dense_bytes))
    return out


@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=2), dict(ep=2)])
def test_delta_push_through_tp_ep_gathers_rebuilds_the_dense_tensors(layout, tiny_dense, tiny_moe):
    from tests._dist import run_distributed

    model = tiny_moe if "ep" in layout else tiny_dense
    rows = run_distributed(_tp_worker, max(layout.values()), model, layout)[0]
    assert [r[0] for r in rows] == [True, False, False, False]
    assert all(same for _, same, _, _ in rows)
    assert all(sent < 0.1 * dense for full, _, sent, dense in rows if not full)
