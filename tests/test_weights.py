"""HF <-> Megatron weights: logit parity with transformers (TP=1, TP=2, EP=2; Qwen3 and Llama) and round trips."""

import os
import shutil

import pytest
import torch

from tests._dist import run_distributed


def _hf_logits(model_dir, ids):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(ids).logits


def _ids(seed=0, batch=2, seq=24):
    return torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _parity_worker(model_dir, tp, ep, etp=1):
    """Runs on each rank: Megatron logits (gathered over TP) and the exported HF tensors."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.models import build_from_hf, forward_logits
    from megatron_grpo.models.weights import export_hf_tensors
    from megatron_grpo.parallel import comm, state

    state.initialize_model_parallel(state.Layout(world_size=int(os.environ.get("WORLD_SIZE", "1")), tp=tp, ep=ep,
                                                 etp=etp))
    model, shape = build_from_hf(model_dir)
    with torch.no_grad():
        logits = forward_logits(model, _ids())
    full = comm.all_gather_cat(logits, -1, ps.get_tensor_model_parallel_group())
    exported = {k: v.clone() for k, v in export_hf_tensors(model, shape, include_tied_lm_head=False)}
    return full, exported, push_twice(model, shape)


COLLECTIVES = ("gather", "all_gather", "broadcast", "send", "recv", "send_object_list", "recv_object_list",
               "broadcast_object_list", "all_gather_object")


def push_twice(model, shape, dtype=torch.bfloat16):
    """Two weight pushes through the sender path (``hf_tensors_on_rank0``), each with the collectives
    this rank called through ``torch.distributed`` (name, dtype of the tensor it sent)."""
    import torch.distributed as dist

    from megatron_grpo.rollout.transfer.weight_sync import hf_tensors_on_rank0

    calls, originals = [], {n: getattr(dist, n) for n in COLLECTIVES}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append((name, args[0].dtype if args and torch.is_tensor(args[0]) else None))
            return fn(*args, **kwargs)
        return wrapped

    for name, fn in originals.items():
        setattr(dist, name, spy(name, fn))
    pushes = []
    try:
        for _ in range(2):
            start = len(calls)
            pushed = {k: v.clone() for k, v in hf_tensors_on_rank0(model, shape, dtype)}
            pushes.append((pushed, calls[start:]))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return pushes


def check_pushes(pushes_by_rank, full, dtype=torch.bfloat16):
    """Rank 0 receives every tensor, cast, on both pushes; no other rank ends up with one; shards are
    cast before they are gathered; metadata (objects) crosses on the first push only."""
    for rank, pushes in enumerate(pushes_by_rank):
        for pushed, calls in pushes:
            if rank > 0:
                assert pushed == {}, rank
                continue
            assert set(pushed) == set(full)
            for name, tensor in full.items():
                assert pushed[name].dtype == dtype and torch.equal(pushed[name], tensor.to(dtype)), name
        for pushed, calls in pushes:
            assert all(dt in (None, dtype) for _, dt in calls), calls  # cast before every gather / send
            assert not [c for c in calls if c[0] in ("all_gather", "all_gather_object")], calls  # to the sender only
        assert not [c for c in pushes[1][1] if c[0].endswith("object_list")], "metadata sent again"


def _check(results, model_dir, tol):
    from safetensors.torch import load_file

    ref = _hf_logits(model_dir, _ids())
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    for logits, exported, _ in results:
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() <= tol
        assert set(exported) == set(original)
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), name
    tied = {"lm_head.weight": original.get("lm_head.weight", original["model.embed_tokens.weight"])}
    check_pushes([pushes for _, _, pushes in results], {**original, **tied})  # a push names the tied head too


@pytest.mark.parametrize("which, tol", [("dense", 1e-4), ("moe", 1e-3)])
def test_tp1_logits_match_transformers_and_round_trip(which, tol, tiny_dense, tiny_moe):
    model_dir = tiny_dense if which == "dense" else tiny_moe
    _check(run_distributed(_parity_worker, 1, model_dir, 1, 1), model_dir, tol)


def test_tp2_dense_logits_and_bit_exact_round_trip(tiny_dense):
    _check(run_distributed(_parity_worker, 2, tiny_dense, 2, 1), tiny_dense, 1e-4)


@pytest.mark.parametrize("ep, etp", [(2, 1), (1, 2)], ids=["ep2", "etp2"])
def test_expert_parallel_moe_logits_and_round_trip(ep, etp, tiny_moe):
    _check(run_distributed(_parity_worker, 2, tiny_moe, 1, ep, etp), tiny_moe, 1e-3)


def test_tied_embeddings_parity(tiny_tied, megatron_single):
    from megatron_grpo.models import build_from_hf, forward_logits
    from megatron_grpo.models.weights import export_hf_tensors

    model, shape = build_from_hf(tiny_tied)
    assert shape.tie_word_embeddings
    with torch.no_grad():
        logits = forward_logits(model, _ids())
    assert (logits - _hf_logits(tiny_tied, _ids())).abs().max().item() <= 1e-4
    exported = dict(export_hf_tensors(model, shape))
    assert torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])


def test_llama_tp2_logits_and_bit_exact_round_trip(tiny_llama):
    """Llama (no QK-norm, tied embeddings, GQA, rope theta 1e5, eps 1e-5): Megatron at TP=2 gives
    transformers' logits; HF -> Megatron TP=2 -> HF is bit-exact; pushes carry every tensor."""
    from megatron_grpo.models import load_hf_config, shape_from_hf

    shape = shape_from_hf(load_hf_config(tiny_llama))
    assert (shape.model_type, shape.qk_norm, shape.tie_word_embeddings) == ("llama", False, True)
    assert (shape.num_heads, shape.num_kv_heads, shape.rope_theta, shape.rms_norm_eps) == (4, 2, 1e5, 1e-5)
    _check(run_distributed(_parity_worker, 2, tiny_llama, 2, 1), tiny_llama, 1e-4)


@pytest.mark.parametrize("change, named", [
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope scaling 'llama3'"),
    (dict(attention_bias=True), "attention_bias"), (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'")])
def test_llama_configs_the_builder_does_not_map_are_refused(change, named, tiny_llama):
    from megatron_grpo.models import load_hf_config, shape_from_hf

    cfg = dict(load_hf_config(tiny_llama), rope_parameters=None, **change)
    with pytest.raises(ValueError, match=named):
        shape_from_hf(cfg)


def test_missing_tensor_names_file_and_tensor(tiny_dense, tmp_path, megatron_single):
    from safetensors.torch import load_file, save_file

    from megatron_grpo.models import build_from_hf

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dense, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.weight") as err:
        build_from_hf(str(broken))
    assert str(broken) in str(err.value)


def test_mismatched_shape_names_tensor(tiny_dense, tmp_path, megatron_single):
    from safetensors.torch import load_file, save_file

    from megatron_grpo.models import build_from_hf

    broken = tmp_path / "bad-shape"
    shutil.copytree(tiny_dense, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :-4].contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight"):
        build_from_hf(str(broken))


def test_missing_checkpoint_dir_is_clear(tmp_path, megatron_single):
    from megatron_grpo.models import build_from_hf

    with pytest.raises(FileNotFoundError, match="no HF config"):
        build_from_hf(str(tmp_path / "nope"))


def test_truncated_safetensors_names_file(tiny_dense, tmp_path, megatron_single):
    from megatron_grpo.models import build_from_hf

    broken = tmp_path / "truncated"
    shutil.copytree(tiny_dense, broken)
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        build_from_hf(str(broken))


def test_push_buckets_equal_the_export_and_copy_only_where_needed(tiny_dense, megatron_single):
    """The push's buckets (``hf_buckets``) hold exactly the exported HF tensors. At TP = 1 in the trainer's
    dtype they are read from the live parameters (no copy: the push is synchronous); a cast gets tensors of
    its own; a delta push in the same dtype reads the live parameters too and its state keeps one copy of each
    shard as last sent (later delta pushes update it in place)."""
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.models.weights import export_hf_tensors
    from megatron_grpo.rollout.transfer.delta import DELTA_MARK, DeltaState
    from megatron_grpo.rollout.transfer.weight_sync import PushReport, hf_buckets

    model, shape = build_from_hf(tiny_dense)
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exported = dict(export_hf_tensors(model, shape))

    def pushed(dtype, delta=None):
        buckets = hf_buckets(model, shape, dtype, 1 << 16, PushReport(version=0), delta=delta)
        return {n: t for bucket in buckets for n, t in bucket if n != DELTA_MARK}

    same = pushed(torch.float32)
    assert same.keys() == exported.keys() and all(torch.equal(same[n], exported[n]) for n in exported)
    aliased = {n for n, t in same.items() if t.untyped_storage().data_ptr() in live}
    assert "model.layers.0.self_attn.o_proj.weight" in aliased and "model.layers.0.mlp.down_proj.weight" in aliased
    cast = pushed(torch.bfloat16)
    assert all(torch.equal(cast[n], exported[n].to(torch.bfloat16)) for n in exported)
    delta = DeltaState()
    delta.start()
    kept = pushed(torch.float32, delta)
    assert all(torch.equal(kept[n], exported[n]) for n in exported)
    assert {n for n, t in kept.items() if t.untyped_storage().data_ptr() in live} == aliased
    assert not {n for n, t in delta.shards.items() if t.untyped_storage().data_ptr() in live}
    assert len(delta.shards) == len(list(model.parameters())) and not delta.fulls  # one rank: nothing kept whole
    storage = {n: t.untyped_storage().data_ptr() for n, t in delta.shards.items()}
    delta.finish()
    delta.start()  # a delta push: the kept shards are updated in place, no new copies
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    pushed(torch.float32, delta)
    assert {n: t.untyped_storage().data_ptr() for n, t in delta.shards.items()} == storage
