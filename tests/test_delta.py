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


def test_changes_pack_into_fewer_bytes_than_the_shard_and_the_sender_completes_small_tensors():
    """A rank's changed elements travel as (int32 index, value) pairs padded to the group's count (-1 indices);
    the sender rebuilds values (0 where unchanged) and the mask, completes a checksummed tensor from its kept
    whole copy, and must send a larger partial tensor as a patch even when the patch is not smaller."""
    shard = torch.arange(12, dtype=torch.float32).to(torch.bfloat16).view(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.uint8)
    mask[0, 1] = mask[2, 3] = 1
    packed = D.pack_changes(shard, mask, 3)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * (4 + 2) < shard.numel() * 2
    assert packed[:12].view(torch.int32).tolist() == [1, 11, -1]
    values, got = D.unpack_changes(packed, shard)
    assert torch.equal(got, mask) and values[0, 1] == 1 and values[2, 3] == 11 and values.sum() == 12
    assert D.patch_fits(3, 12, 2) and not D.patch_fits(4, 12, 2)  # 4 x 6 B = the 24 B of 12 bf16 values
    state = D.DeltaState()
    state.fulls["w"] = shard + 100
    whole, exact = state.settle("w", values, got, partial=True, digest_max_numel=12)
    expected = (shard + 100).clone()
    expected[0, 1], expected[2, 3] = 1, 11
    assert exact and torch.equal(whole, expected) and state.fulls["w"] is whole
    large, exact = state.settle("big", values, got, partial=True, digest_max_numel=11)
    assert not exact and large is values and "big" not in state.fulls
    everything = torch.ones(3, 4, dtype=torch.uint8)
    entries, patched = D.encode("big", values, everything, 0, exact=False)
    assert patched and [n for n, _ in entries] == ["big" + D.INDEX, "big" + D.VALUE]
    assert D.encode("big", values, everything, 0)[1] is False  # exact values: dense is cheaper


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


def _counting(comm, counted):
    """Wraps ``comm``'s collectives the push uses: bytes this rank contributes to multi-rank gathers, and to
    the other collectives (the per-tensor change counts)."""
    gather_to, all_reduce_max = comm.gather_to, comm.all_reduce_max

    def counting_gather(tensor, dst, group=None):
        counted["gather"] += tensor.numel() * tensor.element_size() if comm.group_size(group) > 1 else 0
        return gather_to(tensor, dst, group)

    def counting_max(tensor, group=None):
        counted["other"] += tensor.numel() * tensor.element_size() if comm.group_size(group) > 1 else 0
        return all_reduce_max(tensor, group)

    comm.gather_to, comm.all_reduce_max = counting_gather, counting_max


def _gather_bytes_worker(model_dir, digest_limits):
    """Tiny Qwen3-MoE at TP = 2 x EP = 2 on 2 ranks (dense weights gathered over TP, experts over EP), bf16 pushes
    of fp32 weights: per series (``digest_limits``: the size up to which pushed tensors are checksummed, so the
    sender completes them from its kept copy) a full push, sparse, dense and sparse changes, no change. Per push and
    rank: the bytes it contributed to the gathers and other collectives of the delta push, then of a dense push
    of the same weights; whether rank 0's engine holds exactly the dense push's tensors; the bytes the delta
    state keeps."""
    import os

    from megatron_grpo.models import build_from_hf
    from megatron_grpo.parallel import comm, state
    from megatron_grpo.rollout.transfer import weight_sync as W

    state.initialize_model_parallel(state.Layout(world_size=int(os.environ["WORLD_SIZE"]), tp=2, ep=2))
    model, shape = build_from_hf(model_dir, sequence_parallel=True)
    counted = {"gather": 0, "other": 0}
    _counting(comm, counted)
    gen, out = torch.Generator().manual_seed(1), []
    for limit in digest_limits:
        W.DIGEST_MAX_NUMEL = limit
        engine = _Receiver() if int(os.environ["RANK"]) == 0 else None
        delta = D.DeltaState(full_every=0)
        for version, change in enumerate(("none", "sparse", "dense", "sparse", "none")):
            with torch.no_grad():
                for p in model.parameters():  # same draws on every rank: replicated params stay equal
                    if change == "sparse":
                        p.view(-1)[torch.randint(p.numel(), (3,), generator=gen)] += 0.1
                    elif change == "dense":
                        p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            counted.update(gather=0, other=0)
            report = W.push_weights(model, shape, engine, version, dtype=torch.bfloat16, bucket_mb=0.25, delta=delta)
            pushed = dict(counted)
            counted.update(gather=0, other=0)
            dense = {n: t.clone() for n, t in W.hf_tensors_on_rank0(model, shape, torch.bfloat16)}
            same = engine is None or (sorted(dense) == sorted(engine.weights) and all(
                torch.equal(dense[n].view(torch.int16), engine.weights[n].view(torch.int16)) for n in dense))
            kept = {n: t.numel() * t.element_size() for n, t in {**delta.shards, **getattr(delta, "fulls", {})}.items()}
            out.append(dict(limit=limit, version=version, change=change, full=report.full, same=same, delta=pushed,
                            dense=dict(counted), sent=report.num_bytes, sent_dense=report.dense_bytes, kept=kept))
    return out


def test_delta_gathers_at_most_the_dense_bytes_at_tp2_ep2_and_the_plan_counts_the_kept_copy(tiny_moe):
    """One launch, tiny Qwen3-MoE at TP = 2 x EP = 2, bf16 pushes; each series (sender's checksum limit 1M, i.e.
    every tensor completed from its kept copy, and 0: every gathered tensor sent as a patch) is bit-identical to
    a dense push after every push. Per rank, the dense gather carries this rank's bf16 shards of every TP-split
    weight and expert (measured: 655,360 B); the old delta push sent a uint8 mask beside them (983,040 B, 1.5x)
    on every delta push, dense change or not. Now a full push gathers the dense bytes, a dense change the
    dense bytes (+ 16 B per gathered tensor: the change counts), three changed elements per weight at most
    three (index, value) pairs per gather, no change the counts alone. Rank 0 keeps its shards (+ the small gathered tensors whole, which the plan's
    "delta push copy" counts); rank 1 keeps no replicated weight (the old code kept them: 658,944 B)."""
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.trainer.plan import count_params, gathered_checksummed_elements, largest_hf_tensor, memory_plan
    from megatron_grpo.config.schema import Config, from_dict
    from tests._dist import run_distributed

    shape = shape_from_hf(load_hf_config(tiny_moe))
    h, d, e, layers = shape.hidden_size, shape.head_dim, shape.num_experts, shape.num_layers
    count = count_params(shape, tp=2, ep=2)
    replicated = layers * (2 * h + 2 * d + e * h) + h  # norms, q/k norms, router, final norm
    dense_gather = 2 * (count.num_local - replicated)
    gathers = (1 if shape.tie_word_embeddings else 2) + 2 * layers + 3 * layers * e // 2  # TP: qkv, o; EP: gate, up, down
    counts = 16 * gathers  # one [count, inexact] int64 all-reduce per delta gather
    rank0, rank1 = run_distributed(_gather_bytes_worker, 2, tiny_moe, (1 << 20, 0))
    whole = gathered_checksummed_elements(shape, tp=2, ep=2)
    assert whole == layers * ((2 * shape.num_heads + 2 * shape.num_kv_heads) * d * h + 3 * e * shape.moe_ffn_hidden_size * h) \
        + 2 * shape.vocab_size * h  # every TP-split tensor and expert is small here (plus embedding and lm_head)
    for rank, rows in enumerate((rank0, rank1)):
        for row in rows:
            assert row["same"], row
            assert row["dense"] == {"gather": dense_gather, "other": 0}
            delta = row["delta"]
            assert row["full"] == (row["version"] == 0)
            if row["full"]:
                assert delta == row["dense"]
            elif row["change"] == "none":  # nothing changed: only the counts travel
                assert delta == {"gather": 0, "other": counts}
            elif row["change"] == "dense":
                assert delta["gather"] == dense_gather and delta["other"] == counts
            else:  # at most 3 (int32 index, bf16 value) pairs per gather: each shard has 3 changed elements
                assert 0 < delta["gather"] <= gathers * 3 * (4 + 2) and delta["other"] == counts
            kept = sum(row["kept"].values())
            if rank == 1:
                assert kept == dense_gather and not [n for n in row["kept"] if "norm" in n or "router" in n]
            else:
                assert kept == 2 * (count.num_local + (whole if row["limit"] else 0))
    cfg = from_dict(Config, {"policy": {"precision": {"generation_dtype": "bfloat16"},
                                        "megatron_cfg": {"tensor_model_parallel_size": 2,
                                                         "expert_model_parallel_size": 2}},
                             "generation": {"delta_push": True}})
    planned = memory_plan(cfg, shape, 2).term("delta push copy").bytes
    assert planned == sum(rank0[0]["kept"].values()) + 2 * largest_hf_tensor(shape)
