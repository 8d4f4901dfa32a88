"""Pipeline-parallel training (PP = 2 over gloo, Megatron's 1F1B schedule) equals PP = 1: the first
step's loss, precision/* and clip/* metrics and grad norm, the updated weights (gathered from both
stages to HF names), for untied and tied embeddings."""

import pytest
import torch

from tests._dist import run_distributed
from tests.test_routing import FP8
from tests.test_weights import check_pushes, push_twice

ROWS, SEQ = 8, 24


def _one_step(model_dir, pp, precision=("policy.precision.generation_dtype=bfloat16",)):
    """One TrainStep.run (bf16 or fp8 shadow: beta != 0) on this rank's share of a fixed batch (PP = 2, or
    PP = 1 x DP = 2 on the same 2 ranks); returns the metrics, the updated weights under HF names
    (every stage exports) and the trainer's log-probs of the whole batch."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.loss import finalize
    from megatron_grpo.observe.metrics_logger import to_host
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.models.weights import export_hf_tensors
    from megatron_grpo.parallel import state
    from tests.test_routing import _step_batch, _stepper

    state.initialize_model_parallel(state.Layout(world_size=2, pp=pp))
    _refuse_pickled_tensors()
    st = _stepper(model_dir, *precision, "loss_fn.ratio_clip_min=0.001",
                  "loss_fn.ratio_clip_max=0.001", "grpo.deployed_improvement=true")
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    gen = torch.Generator().manual_seed(3)
    old = -7.0 + 0.01 * torch.randn(ROWS, SEQ, generator=gen)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)
    stats, extra = st.run(_step_batch(old, torch.linspace(-1.0, 1.0, ROWS, dtype=torch.float64), rows=rows), 1)
    assert all(v.device == st.last_log_probs[0].device for v in [*stats.sums.values(), *stats.maxes.values()])
    metrics = finalize(*stats.reduce(st.dp_group))
    metrics.update(extra)
    shape = shape_from_hf(load_hf_config(st.cfg.policy.model_name))
    weights = {k: v.clone() for k, v in export_hf_tensors(st.model, shape)}
    lp = torch.cat(comm_gather(st.last_log_probs[0], ps.get_data_parallel_group()))
    return to_host(metrics), weights, lp, push_twice(st.model, shape)


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


def _both_layouts(untied, tied):
    """The tied model with the fp8 shadow (each stage quantizes its own layers; the stages pass bf16)."""
    return {name: {pp: _one_step(model_dir, pp, *precision) for pp in (1, 2)} for name, model_dir, *precision in
            (("untied", untied), ("tied", tied, FP8))}


@pytest.fixture(scope="module")
def tied_dense(tmp_path_factory):
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tied"), "qwen3", tie_word_embeddings=True)


def test_pp2_step_equals_pp1(tiny_dense, tied_dense):
    """... and the weight push: stage 1's leader sends its layers to rank 0 (names and shapes on the first
    push only); at PP = 1 x DP = 2 the second replica takes no part in the push at all."""
    ranks = run_distributed(_both_layouts, 2, tiny_dense, tied_dense)
    for name in ("untied", "tied"):
        check_pushes([r[name][2][3] for r in ranks], ranks[0][name][2][1])
        check_pushes([r[name][1][3] for r in ranks], ranks[0][name][1][1])
        assert ranks[1][name][1][3][0][1] == [] and ranks[1][name][1][3][1][1] == []  # DP replica: no collective
        assert any(c[0] == "send_object_list" for c in ranks[1][name][2][3][0][1])  # PP: headers, first push
    for results in ranks:
        for name, by_pp in results.items():
            (ref, ref_w, ref_lp, _), (metrics, weights, lp, _) = by_pp[1], by_pp[2]
            assert ref["precision/beta_abs_mean"] > 0 and ref["clip/region_fraction"] > 0, name
            torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0, msg=name)
            for key in [k for k in ref if k.startswith(("precision/", "clip/", "loss", "train/grad_norm"))]:
                assert metrics[key] == pytest.approx(ref[key], abs=1e-5, rel=1e-5), (name, key)
            assert sorted(weights) == sorted(ref_w)
            for key, w in ref_w.items():
                torch.testing.assert_close(weights[key], w, atol=1e-6, rtol=0, msg=f"{name} {key}")
