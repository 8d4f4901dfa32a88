"""Pipeline parallelism (PP = 2 over gloo, Megatron's 1F1B schedule) equals PP = 1: the first step's loss,
precision/*, clip/* and MoE routing metrics, grad norm and grad/cos_clean, the updated weights (gathered from
both stages to HF names), for untied and tied embeddings, a MoE model (routing metrics over every stage's layers) and
uneven stages (a 5-layer model split 2 + 3 and 3 + 2: Megatron's uneven-PP fields, placed as Megatron
places them, their HF weights loaded, exported and pushed at the uneven layer offsets). One 2-rank launch
serves every check of these; ``--dry-run`` counts each stage's layers of the 94-layer Qwen3-235B at PP = 4 and 8."""

import dataclasses
import importlib.util
import os
import sys
import time

import pytest
import torch

from tests._dist import run_distributed
from tests.test_routing import FP8, near_tie_moe  # noqa: F401  (near_tie_moe: a fixture, the MoE case)
from tests.test_weights import check_pushes, push_twice

ROWS, SEQ = 8, 24
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
from bench_checkpoint_load import read_bytes  # noqa: E402  (tools/: torch_dist's read counter)


def _one_step(model_dir, pp, split=None, precision=("policy.precision.generation_dtype=bfloat16",)):
    """One TrainStep.run (bf16 or fp8 shadow: beta != 0) on this rank's share of a fixed batch (PP = 2, or
    PP = 1 x DP = 2 on the same 2 ranks; ``split``: uneven stages); returns the metrics, the updated
    weights under HF names (every stage exports), the trainer's log-probs of the whole batch, two pushes,
    and the stage's facts: its weights under HF names before the step, its parameter count, layers and offset."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.loss import finalize
    from megatron_grpo.observe.metrics_logger import to_host
    from megatron_grpo.models import unwrap
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.models.weights import RankPlacement, export_hf_tensors
    from megatron_grpo.parallel import state
    from megatron_grpo.parallel.stages import PipelineSplit
    from tests.test_routing import _step_batch, _stepper

    split = split or PipelineSplit()
    state.initialize_model_parallel(state.Layout(world_size=2, pp=pp, split=split))
    _refuse_pickled_tensors()
    st = _stepper(model_dir, *precision, "loss_fn.ratio_clip_min=0.001", "loss_fn.ratio_clip_max=0.001",
                  "grpo.deployed_improvement=true", "grpo.grad_cos_clean_every=1", pipeline_split=split)
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    shape = shape_from_hf(load_hf_config(st.cfg.policy.model_name))
    place = RankPlacement.current(st.model)
    stage = dict(initial={k: v.clone() for k, v in export_hf_tensors(st.model, shape)}, layers=place.num_local_layers,
                 offset=place.layer_offset, params=sum(p.numel() for p in unwrap(st.model).parameters()),
                 rank=ps.get_pipeline_model_parallel_rank())
    gen = torch.Generator().manual_seed(3)
    old = -7.0 + 0.01 * torch.randn(ROWS, SEQ, generator=gen)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)
    recipe = st.cfg.policy.precision.fp8.recipe() if st.cfg.policy.precision.generation_dtype == "fp8" else None
    gloo = model_dir.endswith("tiny-qwen3") and HAVE_VLLM  # the untied case (vLLM packs the gloo buckets)
    stage["generator"], delta = _stage_pushes(st.model, shape, recipe, gloo)
    stats, extra = st.run(_step_batch(old, torch.linspace(-1.0, 1.0, ROWS, dtype=torch.float64), rows=rows), 1)
    assert all(v.device == st.last_log_probs[0].device for v in [*stats.sums.values(), *stats.maxes.values()])
    metrics = finalize(*stats.reduce(st.dp_group))
    metrics.update(extra)
    weights = {k: v.clone() for k, v in export_hf_tensors(st.model, shape)}
    lp = torch.cat(comm_gather(st.last_log_probs[0], ps.get_data_parallel_group()))
    twice = push_twice(st.model, shape)  # the funnel's first push after the step (headers cross once)
    stage["generator"]["after"] = _delta_push_after_step(st.model, shape, *delta)
    return to_host(metrics), weights, lp, twice, stage


def _stage_pushes(model, shape, recipe, gloo):
    """Before the step (the loaded weights: equal at every layout): a bf16 push into a file generator (the first
    push of a delta state: full), the fp8 push where ``recipe``, and with ``gloo`` two pushes through a gloo
    transfer group. At PP = 2 every stage's leader sends its own layers. Per push, this rank's view: the
    generator's tensors (rank 0), the names and bytes this rank sent it, the stages' bytes (rank 0) and the
    tensor bytes this rank sent other trainer ranks."""
    from megatron_grpo.models.fp8 import FP8_DTYPE
    from megatron_grpo.rollout.transfer import delta as D
    from megatron_grpo.rollout.transfer.stage_push import STAGE_SENDERS
    from megatron_grpo.rollout.pool import EnginePool
    from megatron_grpo.rollout.transfer.weight_sync import push_weights
    from tests._generators import FileGenerator, GlooGenerator, trainer_sends

    rank0, out, started = int(os.environ["RANK"]) == 0, {}, time.perf_counter()
    file_gen, delta = EnginePool(lambda i: FileGenerator(), 2) if rank0 else None, D.DeltaState()  # 2 readers
    runs = [("bf16", file_gen, torch.bfloat16, delta)] + ([("fp8", FileGenerator() if rank0 else None, FP8_DTYPE,
                                                            None)] if recipe else [])
    if gloo:
        gloo_gen = GlooGenerator() if rank0 else None
        runs += [("gloo", gloo_gen, torch.bfloat16, None), ("gloo_again", gloo_gen, torch.bfloat16, None)]
    for kind, gen, dtype, state in runs:
        with trainer_sends() as sent:
            report = push_weights(model, shape, gen, 1, dtype=dtype, bucket_mb=0.02, delta=state,
                                  fp8=recipe if dtype == FP8_DTYPE else None)
        out[kind] = dict(weights=None if gen is None else dict(_held(gen)), names=list(report.names),
                         bytes=report.num_bytes, stage_bytes=report.stage_bytes, sent=sum(b for _, b in sent),
                         digests=dict(getattr(gen, "pushed_digests", {})))
    if gloo:
        STAGE_SENDERS.close()
        if rank0:
            gloo_gen.close()
    out["seconds"] = time.perf_counter() - started
    return out, (file_gen, delta)


def _held(gen):
    """A generator's tensors (a pool's: its engines', which must agree)."""
    held = [e.weights for e in getattr(gen, "engines", [gen])]
    assert all(_same(h, held[0]) for h in held[1:])
    return held[0]


def _delta_push_after_step(model, shape, gen, delta):
    """After the step: a delta push from every stage into the same generator, then a full push of the same weights
    through rank 0 (``from_every_stage=False``, the funnel) into a fresh one; the tensors each holds, the delta
    push's report (rank 0) and the tensor bytes each rank sent other trainer ranks in each push."""
    from megatron_grpo.rollout.transfer.weight_sync import push_weights
    from tests._generators import FileGenerator, trainer_sends

    funnel, started = FileGenerator() if gen is not None else None, time.perf_counter()
    with trainer_sends() as sent_delta:
        report = push_weights(model, shape, gen, 2, dtype=torch.bfloat16, bucket_mb=0.02, delta=delta)
    with trainer_sends() as sent_funnel:
        push_weights(model, shape, funnel, 2, dtype=torch.bfloat16, bucket_mb=0.02, from_every_stage=False)
    return dict(delta=None if gen is None else dict(_held(gen)), funnel=None if gen is None else funnel.weights,
                full=report.full, sent_delta=sum(b for _, b in sent_delta), sent_funnel=sum(b for _, b in sent_funnel),
                seconds=time.perf_counter() - started)


def _refuse_pickled_tensors():
    """Objects broadcast between ranks must carry no tensors: a pickled CUDA tensor is unpickled onto the
    sender's device index on every receiver (stats go through tensor broadcasts instead)."""
    import io
    import pickle

    import torch.distributed as dist

    original = dist.broadcast_object_list

    class Refuse(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor):
                raise AssertionError(f"a tensor {tuple(obj.shape)} went through broadcast_object_list")
            return NotImplemented

    def checked(objects, *args, **kwargs):
        for obj in objects:
            Refuse(io.BytesIO()).dump(obj)
        return original(objects, *args, **kwargs)

    dist.broadcast_object_list = checked


def comm_gather(tensor, group):
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


UNEVEN = {"first2": dict(num_layers_in_first_pipeline_stage=2),  # 5 layers: 2 + 3
          "loss": dict(account_for_loss_in_pipeline_split=True)}  # (5 + 1) / 2 = 3 per stage, the last builds 2
BF16 = ("policy.precision.generation_dtype=bfloat16",)
CASES = {"untied": ("untied", [1, 2], BF16), "tied": ("tied", [1, 2], FP8), "moe": ("moe", [1, 2], BF16),
         "five": ("five", [1, *UNEVEN], BF16)}
"""name: (model, layouts, precision): 1 = PP = 1 x DP = 2, 2 = PP = 2, an UNEVEN key = PP = 2 split so. The tied
model runs the fp8 shadow (each stage quantizes its own layers; the stages pass bf16)."""


VPP_RECIPE = (*BF16, "loss_fn.ratio_clip_min=0.001", "loss_fn.ratio_clip_max=0.001", "grpo.deployed_improvement=true",
              "grpo.grad_cos_clean_every=1", "policy.train_micro_batch_size=1")
"""8 micro-batches: the interleaved schedule's steady state (activations and gradients crossing both ways at once)."""


def _vpp_step(model_dir):
    """One TrainStep.run at PP = 2 x VPP = 2 (interleaved virtual stages: two model chunks per rank, Megatron's
    interleaved schedule, the log-prob and bf16 shadow forwards over the chunk list) on the batch ``_one_step``
    trains at PP = 1 x DP = 2; returns what ``_one_step`` does that this layout can give (metrics, the updated
    weights under HF names, the log-probs) and each chunk's placement."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.loss import finalize
    from megatron_grpo.models import model_chunks, unwrap
    from megatron_grpo.models.forward import forward_log_probs
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.models.weights import RankPlacement, export_hf_tensors
    from megatron_grpo.observe.metrics_logger import to_host
    from megatron_grpo.parallel import state
    from megatron_grpo.parallel.stages import PipelineSplit
    from tests.test_routing import _step_batch, _stepper

    split = PipelineSplit(virtual_pipeline_model_parallel_size=2)
    state.initialize_model_parallel(state.Layout(world_size=2, pp=2, split=split))
    st = _stepper(model_dir, *VPP_RECIPE, pipeline_split=split)
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    shape = shape_from_hf(load_hf_config(st.cfg.policy.model_name))
    places = [RankPlacement.current(chunk) for chunk in model_chunks(st.model)]
    stage = dict(chunks=[(p.layer_offset, p.num_local_layers, p.pre_process, p.post_process) for p in places],
                 ddp=[type(c).__name__ for c in st.model], built=[unwrap(c).vp_stage for c in st.model])
    stage["generator"], delta = _stage_pushes(st.model, shape, None, False)
    packed = _step_batch(torch.zeros(ROWS, SEQ), torch.zeros(ROWS, dtype=torch.float64)).packed.rows(slice(0, 3))
    stage["odd"] = forward_log_probs(st.model, packed, compute_dtype=torch.float32, params_dtype=torch.float32,
                                     micro_batch_size=1)  # 3 micro-batches: the last repeated to 4
    old = -7.0 + 0.01 * torch.randn(ROWS, SEQ, generator=torch.Generator().manual_seed(3))
    stats, extra = st.run(_step_batch(old, torch.linspace(-1.0, 1.0, ROWS, dtype=torch.float64)), 1)
    metrics, lp = finalize(*stats.reduce(st.dp_group)), st.last_log_probs[0].clone()
    metrics.update(extra)
    weights = {k: v.clone() for k, v in export_hf_tensors(st.model, shape)}
    stage["generator"]["after"] = _delta_push_after_step(st.model, shape, *delta)
    stage["checkpoint"] = _vpp_checkpoint(st, model_dir, shape)
    return to_host(metrics), weights, lp, None, stage


def _vpp_checkpoint(st, model_dir, shape):
    """The PP = 2 x VPP = 2 stepper's state saved (one sharded state dict per chunk, Adam's moments), then
    step 2; a fresh PP = 1 x DP = 2 model and optimizer load it: its weights under HF names, and its step 2
    on its rows (``tests.test_checkpoint._train_step``), next to the straight run's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.checkpoint import resume, sharded_state
    from megatron_grpo.models.weights import export_hf_tensors
    from megatron_grpo.parallel import state
    from tests.test_checkpoint import _train_step
    from tests.test_routing import _stepper

    path = os.path.join(os.environ["DIST_TEST_DIR"], "vpp-checkpoint")
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    main = sharded_state.has_separate_main_params(st.optimizer.megatron)
    resume.save_sharded(st.model, st.optimizer, path, with_state=True)
    straight = _train_step(st, slice(None), 2)
    state.initialize_model_parallel(state.Layout(world_size=2))
    again = _stepper(model_dir, *VPP_RECIPE)
    again.tp_group, again.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    resume.load_sharded(again.model, again.optimizer, path, step=1, with_state=True, main_params=main)
    loaded = {k: v.clone() for k, v in export_hf_tensors(again.model, shape)}
    rank = ps.get_data_parallel_rank()
    return dict(loaded=loaded, straight=straight, resumed=_train_step(again, slice(4 * rank, 4 * rank + 4), 2))


def _all_cases(models):
    from megatron_grpo.parallel.stages import PipelineSplit

    cases = {name: {lay: _one_step(models[model], 1 if lay == 1 else 2, PipelineSplit(**UNEVEN.get(lay, {})), precision)
                    for lay in layouts} for name, (model, layouts, precision) in CASES.items()}
    cases["untied"]["vpp"] = _vpp_step(models["untied"])
    return cases


@pytest.fixture(scope="module")
def tied_dense(tmp_path_factory):
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tied"), "qwen3", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "five"), "qwen3",
                           overrides=dict(num_hidden_layers=5))


@pytest.fixture(scope="module")
def two_ranks(tiny_dense, tied_dense, near_tie_moe, five_layers):
    """Every case of CASES on 2 gloo ranks, in one launch: each rank's results by case and layout."""
    return run_distributed(_all_cases, 2, {"untied": tiny_dense, "tied": tied_dense, "moe": near_tie_moe,
                                           "five": five_layers})


def _assert_equal_to_pp1(ranks, name, layout, prefixes=("precision/", "clip/", "loss", "train/grad_norm",
                                                      "grad/cos_clean"), weight_atol=1e-6):
    """``grad/cos_clean`` (clipping bends the gradient: < 1) counts each parameter once at every layout; it
    counted the tied embedding twice at PP = 2 (the last stage's output-layer copy): 0.7249 vs 0.7268."""
    for results in ranks:
        (ref, ref_w, ref_lp, _, _), (metrics, weights, lp, _, _) = results[name][1], results[name][layout]
        assert ref["precision/beta_abs_mean"] > 0 and ref["clip/region_fraction"] > 0, name
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0, msg=name)
        keys = [k for k in ref if k.startswith(prefixes)]
        assert keys and set(keys) <= set(metrics), (name, layout)
        for key in keys:
            assert metrics[key] == pytest.approx(ref[key], abs=1e-5, rel=1e-5, nan_ok=True), (name, layout, key)
        assert sorted(weights) == sorted(ref_w)
        for key, w in ref_w.items():
            torch.testing.assert_close(weights[key], w, atol=weight_atol, rtol=0, msg=f"{name} {layout} {key}")


def _same(a, b):
    return sorted(a) == sorted(b) and all(a[n].dtype == b[n].dtype and torch.equal(a[n].view(torch.uint8),
                                                                                  b[n].view(torch.uint8)) for n in a)


def _check_stage_pushes(ranks, name, layout):
    """The push from every stage (``stage_push.py``) at ``layout`` (PP = 2) against PP = 1's: the generator holds
    the same tensors bit for bit (bf16 through files, fp8, gloo twice over one group; after the step a delta push
    equals the funnel's full push); each stage's leader sent exactly its own stage's tensors (by layer offset) and
    their bytes, rank 0 counts each stage's; no tensor crossed between trainer ranks (the funnel moves stage 1's
    bytes through rank 0, rank 1's sends = its stage's bytes)."""
    ref, pushes = ranks[0][name][1][4]["generator"], ranks[0][name][layout][4]["generator"]
    kinds = [k for k in ("bf16", "fp8", "gloo", "gloo_again") if k in ref]
    assert kinds[0] == "bf16" and (name != "tied" or "fp8" in kinds) and (name != "untied" or not HAVE_VLLM
                                                                          or "gloo" in kinds), kinds
    for kind in kinds:
        assert _same(pushes[kind]["weights"], ref[kind]["weights"]), (name, layout, kind)
        whole = ref[kind]["weights"]
        assert sorted(pushes[kind]["names"]) == sorted(whole) and pushes[kind]["stage_bytes"] is not None
        for rank, results in enumerate(ranks):
            stage, mine = results[name][layout][4], results[name][layout][4]["generator"][kind]
            names = mine["names"] if rank else [n for n in mine["names"] if n not in ranks[1][name][layout][4][
                "generator"][kind]["names"]]
            layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
            assert layers == set(range(stage["offset"], stage["offset"] + stage["layers"])), (name, layout, rank)
            edge = {n for n in names if not n.startswith("model.layers.")}  # the embedding / the final norm, head
            assert edge - {"lm_head.weight"} == ({"model.norm.weight"} if rank else {"model.embed_tokens.weight"})
            own = sum(whole[n].numel() * whole[n].element_size() for n in names)
            assert pushes[kind]["stage_bytes"][rank] == own and (rank == 0 or mine["bytes"] == own), (kind, rank)
            assert mine["sent"] == 0, (name, layout, kind, rank)  # nothing between trainer ranks
        if kind.startswith("gloo"):  # the stages' checksums reach rank 0's engine (the parity probe's)
            assert "model.norm.weight" in pushes[kind]["digests"] and "model.layers.0.input_layernorm.weight" in \
                pushes[kind]["digests"]
    after = [r[name][layout][4]["generator"]["after"] for r in ranks]
    assert not after[0]["full"] and _same(after[0]["delta"], after[0]["funnel"]) and after[0]["delta"]
    assert after[0]["sent_delta"] == after[1]["sent_delta"] == 0
    assert after[1]["sent_funnel"] == pushes["bf16"]["stage_bytes"][1] > 0  # the funnel: stage 1 through rank 0


def test_pp2_step_equals_pp1(two_ranks):
    """... and the weight push: stage 1's leader sends its layers to rank 0 (names and shapes on the first
    push only); at PP = 1 x DP = 2 the second replica takes no part in the push at all."""
    for name in ("untied", "tied"):
        check_pushes([r[name][2][3] for r in two_ranks], two_ranks[0][name][2][1])
        check_pushes([r[name][1][3] for r in two_ranks], two_ranks[0][name][1][1])
        assert two_ranks[1][name][1][3][0][1] == [] and two_ranks[1][name][1][3][1][1] == []  # DP replica: none
        assert any(c[0] == "send_object_list" for c in two_ranks[1][name][2][3][0][1])  # PP: headers, first push
        _assert_equal_to_pp1(two_ranks, name, 2)
        _check_stage_pushes(two_ranks, name, 2)


def test_interleaved_virtual_stages_step_equals_pp1(two_ranks):
    """PP = 2 x VPP = 2 (4 layers: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3, one DDP per chunk, the
    embedding on rank 0's first chunk, the head on rank 1's last) trains like PP = 1 x DP = 2: the same
    log-probs, loss, precision / clip metrics, grad norm and updated weights (to Adam's amplification of the
    summation order in near-zero gradients). Eight micro-batches run the schedule's steady state, where gloo
    swapped same-shaped activations and gradients under Megatron's batched point-to-point ops. The push from every stage sends
    each chunk's layers under their global names (the generator holds PP = 1's tensors bit for bit; nothing
    crosses between trainer ranks), and after the step a delta push (chunk-keyed shards) equals a full one."""
    chunks = [r["untied"]["vpp"][4] for r in two_ranks]
    assert [c["chunks"] for c in chunks] == [[(0, 1, True, False), (2, 1, False, False)],
                                             [(1, 1, False, False), (3, 1, False, True)]]
    assert all(c["ddp"] == ["DistributedDataParallel"] * 2 and c["built"] == [0, 1] for c in chunks)
    _assert_equal_to_pp1(two_ranks, "untied", "vpp", weight_atol=1e-4)  # 8 micro-batches vs 1: Adam at lr 2e-3
    for results in two_ranks:  # a forward-only pass of 3 micro-batches (not a multiple of PP): PP = 1's log-probs
        odd, ref_lp = results["untied"]["vpp"][4]["odd"], results["untied"][1][2][:3]
        torch.testing.assert_close(odd, ref_lp, atol=1e-5, rtol=0)
    ref, pushes = two_ranks[0]["untied"][1][4]["generator"], two_ranks[0]["untied"]["vpp"][4]["generator"]
    assert _same(pushes["bf16"]["weights"], ref["bf16"]["weights"])  # the push from every stage, chunk by chunk
    for rank, results in enumerate(two_ranks):
        mine = results["untied"]["vpp"][4]["generator"]["bf16"]
        layers = {int(n.split(".")[2]) for n in mine["names"] if n.startswith("model.layers.")}
        assert layers >= ({1, 3} if rank else {0, 2}) and (rank == 0 or layers == {1, 3}) and mine["sent"] == 0
    after = [r["untied"]["vpp"][4]["generator"]["after"] for r in two_ranks]
    assert not after[0]["full"] and after[0]["delta"] and _same(after[0]["delta"], after[0]["funnel"])
    assert after[0]["sent_delta"] == after[1]["sent_delta"] == 0


def test_interleaved_virtual_stages_checkpoint_loads_at_pp1(two_ranks):
    """A PP = 2 x VPP = 2 checkpoint (per-chunk sharded state dicts, global layer keys) loads at PP = 1 x DP = 2:
    the weights bitwise those the chunks held, and step 2 from there (Adam's moments loaded) equals the
    uninterrupted VPP run's step 2 (to reduction order)."""
    for results in two_ranks:
        _, weights, _, _, stage = results["untied"]["vpp"]
        ckpt = stage["checkpoint"]
        assert _same(ckpt["loaded"], weights)
        _assert_same_step(ckpt["resumed"], ckpt["straight"], exact=False)


def test_moe_routing_metrics_at_pp2_cover_every_stages_layers(two_ranks):
    """A MoE model (one MoE layer per stage at PP = 2) with a bf16 generator whose router flips near-tied
    experts: every rank's routing agreement and route-mismatch fractions count both stages' layers (summed
    over the pipeline group) and equal PP = 1's, as do the rest of the step's metrics."""
    _assert_equal_to_pp1(two_ranks, "moe", 2, prefixes=("moe/", "precision/", "clip/", "loss", "train/grad_norm"))
    ref = two_ranks[0]["moe"][1][0]
    assert ref["moe/route_mismatch_fraction"] > 0.01 and ref["moe/tokens_any_mismatch"] > 0.02
    for results in two_ranks:
        metrics = results["moe"][2][0]
        for key in ("moe/route_mismatch_fraction", "moe/tokens_any_mismatch", "moe/route_replayed_fraction",
                    "precision/beta_abs_mean_route_mismatch", "precision/beta_abs_mean_route_match"):
            assert metrics[key] == pytest.approx(ref[key], abs=1e-12, rel=1e-9), key
    check_pushes([r["moe"][2][3] for r in two_ranks], two_ranks[0]["moe"][2][1])
    _check_stage_pushes(two_ranks, "moe", 2)


def test_uneven_stages_place_load_train_and_push_like_pp1(two_ranks, five_layers):
    """A 5-layer model at PP = 2 (PP does not divide it), split 2 + 3 (``num_layers_in_first_pipeline_stage``)
    and 3 + 2 (``account_for_loss_in_pipeline_split``): each stage builds the layers ``PipelineSplit`` says,
    at its offset; the HF weights land on the right layers (exported before the step: the HF file, bitwise),
    the memory plan's parameter count is the stage's own, one step equals PP = 1 and the push carries every
    layer's updated weights."""
    from safetensors.torch import load_file

    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.parallel.stages import PipelineSplit
    from megatron_grpo.trainer.plan import count_params

    original, shape = load_file(f"{five_layers}/model.safetensors"), shape_from_hf(load_hf_config(five_layers))
    for layout, fields in UNEVEN.items():
        split = PipelineSplit(**fields)
        layers, offsets = split.layers_per_stage(5, 2), split.offsets(5, 2)
        assert layers == {"first2": [2, 3], "loss": [3, 2]}[layout]
        for results in two_ranks:
            stage = results["five"][layout][4]
            s = stage["rank"]
            assert (stage["layers"], stage["offset"]) == (layers[s], offsets[s]), (layout, stage)
            assert stage["params"] == count_params(shape, pp=2, stage=s, stage_layers=layers).num_local
            assert set(stage["initial"]) == set(original)
            for key, tensor in original.items():
                assert torch.equal(stage["initial"][key], tensor), (layout, key)
        _assert_equal_to_pp1(two_ranks, "five", layout)
        check_pushes([r["five"][layout][3] for r in two_ranks], two_ranks[0]["five"][layout][1])
        _check_stage_pushes(two_ranks, "five", layout)


SPLITS = [  # (num_layers, pp, PipelineSplit fields)
    (4, 2, {}), (5, 2, dict(num_layers_in_first_pipeline_stage=2)), (5, 2, dict(num_layers_in_last_pipeline_stage=1)),
    (94, 4, dict(num_layers_in_first_pipeline_stage=22, num_layers_in_last_pipeline_stage=24)),
    (94, 8, dict(num_layers_in_first_pipeline_stage=10)), (94, 4, dict(account_for_embedding_in_pipeline_split=True,
                                                                        account_for_loss_in_pipeline_split=True)),
    (94, 8, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (7, 4, dict(account_for_embedding_in_pipeline_split=True)), (7, 2, dict(account_for_loss_in_pipeline_split=True)),
]
BAD_SPLITS = [(94, 4, {}), (5, 2, dict(num_layers_in_first_pipeline_stage=5)),
              (94, 4, dict(num_layers_in_first_pipeline_stage=23)), (6, 2, dict(account_for_loss_in_pipeline_split=True)),
              (3, 4, dict(account_for_embedding_in_pipeline_split=True))]


def test_pipeline_split_places_layers_as_megatron_does():
    """``PipelineSplit`` (pure arithmetic, used by the dry run, the memory plan and validation) against
    Megatron-Core's own ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` for every stage of
    even, uneven-first / last and embedding / loss-accounted splits; impossible splits are a ValueError
    naming the keys (Megatron's ``TransformerConfig`` refuses them too, or builds a stage without layers)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_grpo.parallel.stages import PipelineSplit

    def config(num_layers, pp, fields):
        return TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                 pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                 use_cpu_initialization=True, **PipelineSplit(**fields).config_kwargs(pp))

    for num_layers, pp, fields in SPLITS:
        split, c = PipelineSplit(**fields), config(num_layers, pp, fields)
        expected = [get_num_layers_to_build(c, pp_rank=s) for s in range(pp)]
        assert split.layers_per_stage(num_layers, pp) == expected and sum(expected) == num_layers, (fields, expected)
        assert split.offsets(num_layers, pp) == [get_transformer_layer_offset(c, pp_rank=s) for s in range(pp)]
    for num_layers, pp, fields in BAD_SPLITS:
        with pytest.raises(ValueError, match="policy.megatron_cfg"):
            PipelineSplit(**fields).layers_per_stage(num_layers, pp)
        try:
            c = config(num_layers, pp, fields)
            assert 0 in [get_num_layers_to_build(c, pp_rank=s) for s in range(pp)]  # Megatron: an empty stage
        except (ValueError, AssertionError):
            pass


VPP_SPLITS = [  # (num_layers, pp, vpp, PipelineSplit fields, the chunks' layers [stage][chunk])
    (8, 2, 2, {}, [[2, 2], [2, 2]]), (12, 2, 3, {}, [[2, 2, 2], [2, 2, 2]]), (8, 4, 2, {}, [[1, 1]] * 4),
    (94, 4, 2, dict(num_layers_in_first_pipeline_stage=22, num_layers_in_last_pipeline_stage=24),
     [[11, 11], [12, 12], [12, 12], [12, 12]]),
    (94, 4, 2, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     [[11, 12], [12, 12], [12, 12], [12, 11]]),
    (7, 2, 2, dict(account_for_loss_in_pipeline_split=True), [[2, 2], [2, 1]]),
]
BAD_VPP_SPLITS = [(6, 2, 4, {}), (5, 2, 2, dict(num_layers_in_first_pipeline_stage=3)),
                  (3, 2, 2, dict(account_for_loss_in_pipeline_split=True))]


def test_virtual_stages_place_model_chunks_as_megatron_does():
    """Interleaved virtual stages: ``PipelineSplit.chunk_layers`` / ``chunk_offsets`` (the dry run, the memory
    plan, validation) against Megatron-Core's ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` for
    every (stage, virtual stage) of even, uneven and embedding / loss-accounted splits; a split whose chunks
    cannot be equal is a ValueError naming the key, which Megatron's ``TransformerConfig`` refuses too (or
    builds an empty chunk); the recipe refuses VPP at PP = 1 and with an FP8 forward."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_grpo.config.schema import MegatronConfig
    from megatron_grpo.models.packing import PlanSpec, plan_groups
    from megatron_grpo.parallel.stages import PipelineSplit

    def config(num_layers, pp, split):
        return TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                 pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                 use_cpu_initialization=True, **split.config_kwargs(pp))

    for num_layers, pp, vpp, fields, want in VPP_SPLITS:
        split = PipelineSplit(**fields, virtual_pipeline_model_parallel_size=vpp)
        c = config(num_layers, pp, split)
        assert c.virtual_pipeline_model_parallel_size == vpp
        assert split.chunk_layers(num_layers, pp) == want == [
            [get_num_layers_to_build(c, vp_stage=v, pp_rank=s) for v in range(vpp)] for s in range(pp)], fields
        offsets = split.chunk_offsets(num_layers, pp)
        assert offsets == [[get_transformer_layer_offset(c, vp_stage=v, pp_rank=s) for v in range(vpp)]
                           for s in range(pp)], fields
        placed = sorted(o + i for s in range(pp) for o, n in zip(offsets[s], want[s]) for i in range(n))
        assert placed == list(range(num_layers))  # every layer once
    for num_layers, pp, vpp, fields in BAD_VPP_SPLITS:
        split = PipelineSplit(**fields, virtual_pipeline_model_parallel_size=vpp)
        with pytest.raises(ValueError, match="policy.megatron_cfg"):
            split.chunk_layers(num_layers, pp)
        try:
            c = config(num_layers, pp, split)
            assert 0 in [get_num_layers_to_build(c, vp_stage=v, pp_rank=s) for s in range(pp) for v in range(vpp)]
        except (ValueError, AssertionError):
            pass
    mask = torch.zeros(5, 32, dtype=torch.bool)
    for row, length in enumerate((30, 20, 12, 9, 4)):
        mask[row, :length] = True
    for spec in (PlanSpec(packing=True, max_tokens=32), PlanSpec(max_tokens=48)):  # 3 packed rows; 3 budget groups
        plain = plan_groups(mask, spec)
        groups = plan_groups(mask, dataclasses.replace(spec, count_multiple=2))
        assert len(plain) % 2 and len(groups) == len(plain) + 1 and sorted(sum(groups, [])) == list(range(5))
    with pytest.raises(ValueError, match=r"policy\.megatron_cfg\.virtual_pipeline_model_parallel_size=2 needs "
                                         r"policy\.megatron_cfg\.pipeline_model_parallel_size > 1"):
        MegatronConfig(virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size must be >= 1"):
        MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0)
    assert MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2).pipeline_split.vpp == 2
    from megatron_grpo.config.schema import Config, from_dict

    vpp = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size=2 with an FP8 forward \(policy\.precision "
                                         r"generation_dtype=fp8.*leave virtual_pipeline_model_parallel_size null"):
        from_dict(Config, {"policy": {"megatron_cfg": vpp, "precision": {"compute_dtype": "bfloat16",
                                                                         "generation_dtype": "fp8"}},
                           "generation": {"backend": "vllm"}})
    assert MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1).pipeline_split \
        .config_kwargs(2) == {}


def test_uneven_keys_are_checked_in_the_recipe_and_ignored_with_a_warning_at_pp1(caplog):
    """``policy.megatron_cfg``'s uneven-PP keys: a count below 1 or the two forms mixed are errors naming
    the keys when the recipe loads; at PP = 1 they do nothing, and a warning says so; a model they cannot
    split is refused by the layout check (before anything is built)."""
    import logging

    from megatron_grpo.config.schema import MegatronConfig
    from megatron_grpo.parallel.state import Layout, validate_layout

    with pytest.raises(ValueError, match=r"policy\.megatron_cfg\.num_layers_in_last_pipeline_stage must be >= 1"):
        MegatronConfig(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=0)
    with pytest.raises(ValueError, match="cannot be combined with account_for_embedding_in_pipeline_split"):
        MegatronConfig(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3,
                       account_for_embedding_in_pipeline_split=True)
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config.schema"):
        m = MegatronConfig(account_for_loss_in_pipeline_split=True)
    assert "account_for_loss_in_pipeline_split=True has no effect with pipeline_model_parallel_size=1" in caplog.text
    assert m.pipeline_split.config_kwargs(1) == {} and m.pipeline_split.layers_per_stage(5, 1) == [5]
    split = MegatronConfig(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=4).pipeline_split
    validate_layout(Layout(world_size=2, pp=2, split=split), num_layers=5)
    with pytest.raises(ValueError, match="the 0 layers left must split evenly over the 1 stage"):
        validate_layout(Layout(world_size=2, pp=2, split=split), num_layers=4)


def _dry_run_json(capsys, overrides, world=64):
    import json

    from megatron_grpo.trainer.launch import main

    code = main("recipes/grpo-qwen3-235b-a22b-8x8gpu.yaml", overrides, dry_run=True, world_size=world, as_json=True)
    out = capsys.readouterr().out
    return code, (json.loads(out) if code == 0 else out)


@pytest.mark.parametrize("pp, ep, fields, layers", [
    (4, 16, dict(num_layers_in_first_pipeline_stage=23, num_layers_in_last_pipeline_stage=23), [23, 24, 24, 23]),
    (8, 8, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     [11, 12, 12, 12, 12, 12, 12, 11]),
])
def test_dry_run_plans_the_94_layer_235b_over_uneven_stages(pp, ep, fields, layers, capsys, monkeypatch):
    """Qwen3-235B-A22B (94 layers) at PP = 4 and PP = 8 on 64 GPUs: refused without uneven stages (naming the
    keys that fix it); with them the dry run lists each stage's layers and plans every stage with its own
    layer count: the planned rank's parameters are its layers' (the per-layer count, by hand, times that
    stage's layers, plus the embedding on stage 0)."""
    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.trainer.plan import GIB, count_params

    monkeypatch.chdir(ROOT)
    base = [f"policy.megatron_cfg.pipeline_model_parallel_size={pp}", f"policy.megatron_cfg.expert_model_parallel_size={ep}"]
    code, out = _dry_run_json(capsys, base)
    assert code == 2 and "num_layers_in_first_pipeline_stage" in out and "num_hidden_layers=94" in out
    keys = [f"policy.megatron_cfg.{k}={str(v).lower()}" for k, v in fields.items()]
    code, out = _dry_run_json(capsys, base + keys)
    assert code == 0 and out["layout"]["layers_per_stage"] == layers
    memory = out["memory"]
    stage = memory["stage"]
    assert memory["layers_per_stage"] == layers and stage in (0, pp - 1)
    cfg = load_recipe("recipes/grpo-qwen3-235b-a22b-8x8gpu.yaml", base + keys)
    shape = shape_from_hf(load_hf_config(cfg.policy.model_name))
    h, tp = shape.hidden_size, 4
    attention = h * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp + shape.num_heads * shape.head_dim * h // tp
    dense_layer = attention + 2 * h + 2 * shape.head_dim + shape.num_experts * h  # norms, q/k norms, router
    expert_layer = 3 * h * shape.moe_ffn_hidden_size * shape.num_experts // ep
    embedding = shape.vocab_size * h // tp
    expected = layers[stage] * (dense_layer + expert_layer) + (embedding if stage == 0 else embedding + h)
    params = next(t for t in memory["terms"] if t["name"] == "parameters")
    assert params["bytes"] == 4 * expected, (params["bytes"] / GIB, 4 * expected / GIB)
    assert count_params(shape, tp=4, pp=pp, ep=ep, stage=stage, stage_layers=layers).num_local == expected


# ---- checkpoints at PP = 2 (4 ranks, one launch): resume, fully parallel load, PP = 2 -> 1, export ----------

def _build(model_dir, split=None, **layout):
    """A stepper at ``layout`` on every rank of the world (``split``: uneven stages) and this rank's rows."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.parallel import state
    from megatron_grpo.parallel.stages import PipelineSplit
    from tests.test_routing import ROWS, _stepper

    split = split or PipelineSplit()
    state.init_distributed()
    state.initialize_model_parallel(state.Layout(world_size=dist.get_world_size(), split=split, **layout))
    st = _stepper(model_dir, pipeline_split=split)
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return st, slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)


CKPT_CASES = {  # name: (model, layout at save, async save)
    "dense": ("tied", dict(pp=2), False),  # PP = 2 x DP = 2, tied embeddings
    "moe": ("moe", dict(pp=2, ep=2), True),  # PP = 2 x EP = 2, saved in the background
    "uneven": ("five", dict(pp=2, split=dict(num_layers_in_first_pipeline_stage=2)), False),  # 2 + 3, DP = 2
}


def _layout_args(layout):
    from megatron_grpo.parallel.stages import PipelineSplit

    layout = dict(layout)
    return dict(layout, split=PipelineSplit(**layout.pop("split", {})))


def _save_at_pp2(models, root):
    """Each case at its PP = 2 layout: step 1, its weights under HF names, a save (``moe``: asynchronous,
    finalized after step 2), step 2 (the uninterrupted run). ``dense``: then a fresh model and optimizer
    load step 1 with every DP replica reading (bytes counted), and again with the fully parallel load,
    each followed by step 2."""
    from megatron_grpo.checkpoint import resume
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.models.weights import export_hf_tensors
    from tests.test_checkpoint import _train_step, _trainer

    out = {}
    for name, (model, layout, async_save) in CKPT_CASES.items():
        st, rows = _build(models[model], **_layout_args(layout))
        ck = os.path.join(root, name)
        _train_step(st, rows, 1)
        shape = shape_from_hf(load_hf_config(models[model]))
        hf = {k: v.clone() for k, v in export_hf_tensors(st.model, shape, include_tied_lm_head=False)}
        resume.save_checkpoint(_trainer(st, models[model], ck, 1, async_save))
        out[name] = dict(hf=hf, straight=_train_step(st, rows, 2),
                         latest_before_finish=ckpt_latest(ck), finished=resume.finish_pending_save())
        if name == "dense":
            for fully_parallel in (False, True):
                again, rows = _build(models[model], **_layout_args(layout))
                trainer = _trainer(again, models[model], ck, 0)
                trainer.cfg.checkpointing.fully_parallel_load = fully_parallel
                with read_bytes() as nbytes:
                    resume.load_checkpoint(trainer, ckpt_dir(ck, 1))
                out[name][f"resumed_fp{int(fully_parallel)}"] = nbytes[0], _train_step(again, rows, 2)
        elif name == "moe":
            again, rows = _build(models[model], **_layout_args(layout))
            resume.load_checkpoint(_trainer(again, models[model], ck, 0), ckpt_dir(ck, 1))
            out[name]["resumed"] = _train_step(again, rows, 2)
    return out


def _load_at_pp1(models, root):
    """PP = 1 x DP = 4 (the MoE: x EP = 2): each PP = 2 checkpoint of step 1 loaded, then step 2; the dense
    and uneven ones saved again at PP = 1 (for the export). Then the 5-layer checkpoint loaded into the
    4-layer model: the error."""
    from megatron_grpo.checkpoint import folders as ckpt
    from megatron_grpo.checkpoint import resume
    from tests.test_checkpoint import _train_step, _trainer

    out = {}
    for name, (model, layout, _) in CKPT_CASES.items():
        st, rows = _build(models[model], ep=layout.get("ep", 1))
        trainer = _trainer(st, models[model], os.path.join(root, name), 0)
        resume.load_checkpoint(trainer, ckpt_dir(os.path.join(root, name), 1))
        out[name] = dict(position=trainer.ctx.sampler.position, step=trainer.step,
                         layout=ckpt.read_trainer_state(ckpt_dir(os.path.join(root, name), 1))["layout"])
        if name != "moe":
            resume.save_checkpoint(_trainer(st, models[model], os.path.join(root, f"{name}-pp1"), 1))
        out[name]["resumed"] = _train_step(st, rows, 2)
    st, _ = _build(models["untied"])
    try:
        resume.load_checkpoint(_trainer(st, models["untied"], root, 0), ckpt_dir(os.path.join(root, "uneven"), 1))
    except ckpt.CheckpointError as exc:
        out["error"] = str(exc)
    return out


def ckpt_dir(root, step):
    from megatron_grpo.checkpoint import folders as ckpt

    return ckpt.step_dir(root, step)


def ckpt_latest(root):
    from megatron_grpo.checkpoint import folders as ckpt

    return ckpt.latest_step(root)


def _save_then_load(models, root):
    return _save_at_pp2(models, root), _load_at_pp1(models, root)


@pytest.fixture(scope="module")
def pp2_checkpoints(tmp_path_factory, tiny_dense, tied_dense, near_tie_moe, five_layers):
    """CKPT_CASES saved at PP = 2, then loaded at PP = 1, on 4 ranks (one launch)."""
    models = {"untied": tiny_dense, "tied": tied_dense, "moe": near_tie_moe, "five": five_layers}
    root = str(tmp_path_factory.mktemp("pp2-checkpoints"))
    saved, loaded = zip(*run_distributed(_save_then_load, 4, models, root))
    return root, models, list(saved), list(loaded)


def _assert_same_step(got, want, exact=True):
    (metrics, lp), (ref, ref_lp) = got, want
    assert set(metrics) == set(ref)
    for key, value in ref.items():
        if exact:
            assert metrics[key] == value or (value != value and metrics[key] != metrics[key]), key
        else:
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=0 if exact else 1e-6)


def test_resume_at_pp2_equals_the_uninterrupted_run(pp2_checkpoints):
    """Dense PP = 2 x DP = 2 (tied embeddings) and MoE PP = 2 x EP = 2: step 1, save, a fresh model and
    optimizer loading it, step 2: every metric and the log-probs after the update equal the uninterrupted
    step 2 bitwise. The MoE's save is asynchronous at PP = 2: not ``latest`` until finished, then final."""
    root, _, saved, _ = pp2_checkpoints
    for rank in saved:
        dense, moe = rank["dense"], rank["moe"]
        for fully_parallel in (0, 1):
            _assert_same_step(dense[f"resumed_fp{fully_parallel}"][1], dense["straight"])
        _assert_same_step(moe["resumed"], moe["straight"])
        assert moe["latest_before_finish"] is None and moe["finished"] == ckpt_dir(os.path.join(root, "moe"), 1)
        assert dense["latest_before_finish"] == 1 and dense["finished"] is None
    from megatron_grpo.checkpoint import folders as ckpt

    for name in CKPT_CASES:
        ckpt.verify(ckpt_dir(os.path.join(root, name), 1))


def test_fully_parallel_load_reads_each_replicated_shard_once(pp2_checkpoints):
    """PP = 2 x DP = 2 without the distributed optimizer: the model and optimizer shards of each stage are
    replicated over DP. Read by every replica, each DP rank reads its stage's whole state; with Megatron's
    fully parallel load the two replicas split it (together they read what one did, each about half;
    Megatron-Core 0.19 reads one small non-tensor item, ~1 KiB, on both) and exchange the rest, and the
    resumed step is the same bitwise (previous test)."""
    _, _, saved, _ = pp2_checkpoints
    plain = [rank["dense"]["resumed_fp0"][0] for rank in saved]
    fully = [rank["dense"]["resumed_fp1"][0] for rank in saved]
    for stage in (0, 1):  # ranks 2s, 2s + 1: the DP pair of stage s (Megatron's order: DP inside PP)
        a, b = 2 * stage, 2 * stage + 1
        assert plain[a] == plain[b] > 0
        assert plain[a] <= fully[a] + fully[b] <= plain[a] + 4096, (plain, fully)
        assert 0.4 * plain[a] < fully[a] < 0.6 * plain[a] and 0.4 * plain[b] < fully[b] < 0.6 * plain[b], (plain, fully)


def test_pp2_checkpoints_load_at_pp1_and_export_like_pp1(pp2_checkpoints, tmp_path):
    """Each PP = 2 checkpoint (tied dense, MoE x EP = 2, uneven 2 + 3) loads at PP = 1 x DP = 4 with the
    step's trainer state and continues like the uninterrupted run (to reduction order); the checkpoint
    records the layout it was saved at. ``export-hf`` of the PP = 2 checkpoints equals the export of the
    same state saved at PP = 1, bitwise, and the weights the trainer held (gathered to HF names) bitwise."""
    from safetensors.torch import load_file

    from megatron_grpo.checkpoint.export import export_hf

    root, models, saved, loaded = pp2_checkpoints
    for rank in loaded:
        for name, (_, layout, _) in CKPT_CASES.items():
            got = rank[name]
            assert (got["position"], got["step"]) == (10, 1)
            assert (got["layout"]["pp"], got["layout"]["ep"], got["layout"]["dp"]) == (2, layout.get("ep", 1),
                                                                                     2 if name != "moe" else 2)
            _assert_same_step(got["resumed"], saved[0][name]["straight"], exact=False)
    assert loaded[0]["uneven"]["layout"]["layers_per_stage"] == [2, 3]
    for name in ("dense", "uneven"):
        exported = []
        for source in (name, f"{name}-pp1"):
            report = export_hf(ckpt_dir(os.path.join(root, source), 1), str(tmp_path / source))
            tensors = {}
            for f in report.files:
                tensors.update(load_file(str(tmp_path / source / f)))
            exported.append(tensors)
        pp2, pp1 = exported
        hf = saved[0][name]["hf"]
        assert set(pp2) == set(pp1) == set(hf), name
        for key, tensor in hf.items():
            assert torch.equal(pp2[key], pp1[key]) and torch.equal(pp2[key], tensor), (name, key)


def test_a_checkpoint_another_model_cannot_load_names_both_layouts(pp2_checkpoints):
    """The 5-layer checkpoint saved at PP = 2 (2 + 3) loaded into the 4-layer model at PP = 1 x DP = 4: a
    CheckpointError on every rank naming the checkpoint's layout, this run's, and the tensor that differs."""
    _, _, _, loaded = pp2_checkpoints
    for rank in loaded:
        error = rank["error"]
        assert "saved at TP=1 PP=2 (layers 2+3) CP=1 EP=1 ETP=1 DP=2 on 4 ranks, a model of 5 layers" in error
        assert "this run is at TP=1 PP=1 (layers 4) CP=1 EP=1 ETP=1 DP=4 on 4 ranks, a model of 4 layers" in error
        assert "global shape (5," in error


@pytest.mark.vllm
def test_sigkill_at_pp2_then_resume_reproduces_the_uninterrupted_steps(tmp_path, tiny_moe):
    """``megatron-grpo train`` on 4 ranks, the MoE at PP = 2 x EP = 2 saving asynchronously every step, is
    SIGKILLed after step 3, whose checkpoint does not exist (it was still being written), and resumed from
    step 2's: the re-run step 3 equals the killed run's step 3 (loss, grad norm, rewards, lengths, every metric
    but timings), each step is logged once, and the resumed run's last (asynchronous) save is finished before
    it exits: step 4 is ``latest``, verified, with the data position of 4 steps. (Dense PP = 2 x DP = 2 resumes
    bitwise in ``test_resume_at_pp2_equals_the_uninterrupted_run``; one CLI launch pair keeps CI short.)"""
    from megatron_grpo.checkpoint import folders as ckpt
    from tests.test_checkpoint import _stable
    from tests.test_train import run_cli

    ck = tmp_path / "ck"
    common = [f"policy.model_name={tiny_moe}", "grpo.max_num_steps=4",
              "policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.megatron_cfg.expert_model_parallel_size=2", "checkpointing.async_save=true",
              "checkpointing.save_period=1", f"checkpointing.checkpoint_dir={ck}"]
    os.environ["MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"] = "3"
    try:
        code, out, killed = run_cli(common, str(tmp_path / "run"), nproc=4)
    finally:
        del os.environ["MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"]
    assert code != 0 and [r["step"] for r in killed] == [1, 2, 3], out[-3000:]
    assert ckpt.latest_step(str(ck)) == 2 and 3 not in ckpt.list_checkpoints(str(ck))
    code, out, resumed = run_cli(common + ["checkpointing.resume=true"], str(tmp_path / "run"), nproc=4)
    assert code == 0, out[-3000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and "resumed from" in out
    assert _stable(resumed[2]) == _stable(killed[2])
    assert ckpt.latest_step(str(ck)) == 4
    ckpt.verify(ckpt.step_dir(str(ck), 4))
    state = ckpt.read_trainer_state(ckpt.step_dir(str(ck), 4))
    assert state["data_position"] == 4 * 4 and state["layout"]["pp"] == 2  # 4 prompts per step (the tiny recipe)
