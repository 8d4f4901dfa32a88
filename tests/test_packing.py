"""models/packing.py and its use by the step: packed rows and token-budget micro-batches give the
padded path's log-probs, loss, grad norm and every precision/* and clip/* metric (fp32, 1e-6); no
token attends across sequences; THD ``PackedSeqParams`` boundaries; DP=2, TP=2 with SP, PP=2.
MoE (tiny Qwen3-MoE, z-loss on): the same plus every moe/* routing metric, with R3 (and R2) replay
laid out per packed token, in one process, at EP=2 and at TP=2 with SP."""

import pytest
import torch

from tests._dist import run_distributed
from tests.test_routing import _stepper

PROMPT = 6
LENGTHS = (40, 12, 10, 9, 20, 11, 30, 14)
"""A long-tailed mix: packed rows hold several sequences (capacity 40: [40], [30, 10], [20, 14], ...)."""
PACKED = ("policy.sequence_packing.enabled=true",)
BUDGET = ("policy.dynamic_batching.enabled=true", "policy.dynamic_batching.max_tokens_per_microbatch=64")
TOL = 1e-6
CLIP0 = "policy.megatron_cfg.optimizer.clip_grad=0"
MOE = ("policy.megatron_cfg.moe_z_loss_coeff=0.1",)
R3 = MOE + ("policy.megatron_cfg.moe_routing_replay=R3",)
R2 = MOE + ("policy.megatron_cfg.moe_routing_replay=R2",)
PACKED_64 = PACKED + ("policy.sequence_packing.train_mb_tokens=64",)
MOE_MODES = {"padded": R3, "packed": R3 + PACKED, "budget": R3 + BUDGET, "packed-64": R3 + PACKED_64,
             "padded/R2": R2, "packed/R2": R2 + PACKED}
"""Each mode against the padded one with the same replay (R3: the generator's routes moved, so that the
replay acts; R2: the no-grad forward's own routes, recorded and replayed through the plan)."""


def _sequences(lengths=LENGTHS):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def _packed(seqs=None):
    from megatron_grpo.models.forward import pack

    seqs = seqs or _sequences()
    return pack(seqs, [PROMPT] * len(seqs), 0)


def _inputs():
    """Old (generator) and shadow log-probs near the fp32 model's, far enough to clip and to give
    non-zero precision/* metrics; advantages of both signs. The shadow's noise (std 0.1) sets std(beta):
    ``precision/beta_adv_corr`` moves by about (a log-prob's 1-ulp difference) / std(beta)."""
    g = torch.Generator().manual_seed(1)
    shape = _packed().labels.shape
    return torch.randn(shape, generator=g) * 0.3, torch.randn(shape, generator=g) * 0.1, \
        torch.linspace(-1.0, 1.0, len(LENGTHS), dtype=torch.float64)


def _step(st, rows=slice(None), routes=None):
    """The step's log-probs, then one forward-backward with given old / shadow log-probs: metrics,
    the global grad norm, the trainer's log-probs. MoE: the no-grad forward's routing stands in for
    the shadow's (R2 replays it; the routing metrics compare with it), R3 replays ``routes``."""
    from megatron_grpo.loss import finalize
    from megatron_grpo.trainer.step import StepBatch

    old_noise, shadow_noise, adv = _inputs()
    packed = _packed()
    st.current_step, st.nonfinite, st.replay_routes = 1, [], None
    st.plan = None
    lp = st.lowp_log_probs(packed, temperature=1.0)
    natural = None if st.routing is None else st.routing.take(packed.input_ids.shape[1], "natural")[rows]
    batch = StepBatch(packed.rows(rows), (lp + old_noise)[rows], adv[rows], packed.mask.sum().double(),
                      packed.mask.any(-1).sum().double(), None if routes is None else routes[rows])
    st.plan = st.make_plan(batch.packed)
    replay = natural if st.replay == "R2" else st._generator_routes(batch)
    st.optimizer.zero_grad()
    shadow = (lp + shadow_noise)[rows]
    stats, train_lp = st.forward_backward(batch, shadow, None, replay)
    if st.routing is not None:
        st._routing_stats(stats, batch, train_lp, shadow, natural)
    st.optimizer.megatron.prepare_grads()
    metrics = {k: v.item() for k, v in finalize(*stats.reduce(st.dp_group)).items()}
    metrics["train/grad_norm"] = float(st.optimizer.megatron.get_grad_norm())
    st.plan = None
    return {"metrics": metrics, "lp": lp, "train_lp": train_lp, "mask": batch.packed.mask,
            "computed": sum(mb.num_computed_tokens for mb in st.make_plan(batch.packed, equalise=False))}


def _moved_routes(model_dir):
    """R3 routes: the model's own (padded) routing, layer 1's completion positions moved to experts (0, 3)."""
    st = _stepper(model_dir)
    st.lowp_log_probs(_packed(), temperature=1.0)
    moved = st.routing.take(_packed().input_ids.shape[1], "natural").clone()
    moved[:, PROMPT - 1:, 0] = torch.tensor([0, 3], dtype=moved.dtype)
    return moved


def _assert_same(got, ref):
    """Same rows: log-probs at valid tokens, loss, grad norm, every precision/* and clip/* metric."""
    assert (got["lp"] - ref["lp"]).abs()[_packed().mask].max().item() <= TOL
    assert (got["train_lp"] - ref["train_lp"]).abs()[ref["mask"]].max().item() <= TOL
    names = [n for n in ref["metrics"] if n.startswith(("precision/", "clip/", "loss/", "policy/", "moe/"))]
    assert any(n.startswith("precision/") for n in names) and any(n.startswith("clip/") for n in names)
    assert ref["metrics"]["clip/region_fraction"] > 0  # the metrics are not trivially zero
    for name in names + ["train/grad_norm"]:
        assert got["metrics"][name] == pytest.approx(ref["metrics"][name], abs=TOL, rel=TOL), name


# ---- plans, no model -------------------------------------------------------------------------------------


def test_block_causal_mask_and_thd_boundaries():
    from megatron_grpo.models.packing import PlanSpec, block_causal_mask, build_plan

    mask = block_causal_mask([2, 3])[0, 0]
    allowed = ~mask
    assert allowed.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    packed = _packed()
    plan = build_plan(packed.input_ids, packed.labels, packed.mask, PlanSpec(packing=True, multiple=16, thd=True))
    needed = [n - 1 for n in LENGTHS]  # tokens up to the last completion label
    for mb in plan:
        assert mb.attention_mask is None and mb.packed_seq_params.qkv_format == "thd"
        lens = [needed[i] for i in mb.seqs.tolist()]
        width = mb.input_ids.shape[1]
        assert width % 16 == 0 and width >= sum(lens)
        tail = [width - sum(lens)] if width > sum(lens) else []
        expect = torch.cumsum(torch.tensor([0, *lens, *tail]), 0).int()
        assert torch.equal(mb.packed_seq_params.cu_seqlens_q, expect)
        assert torch.equal(mb.packed_seq_params.cu_seqlens_kv, expect)
        assert mb.packed_seq_params.max_seqlen_q == max(lens + tail)
        starts = expect[:-1].tolist()
        assert all(mb.position_ids[0, s].item() == 0 for s in starts)  # positions restart per sequence
    assert sorted(i for mb in plan for i in mb.seqs.tolist()) == list(range(len(LENGTHS)))
    assert len(plan) < len(LENGTHS)  # rows hold several sequences


def test_token_budget_groups_and_equal_counts():
    from megatron_grpo.models.packing import group_by_tokens, split_to_count
    from megatron_grpo.trainer.step import balanced_ranks

    groups = group_by_tokens([40, 12, 10, 9, 20, 11, 30, 14], budget=64, multiple=8)
    assert groups == [[0], [6, 4], [7, 1, 5, 2], [3]]
    assert sum(len(g) for g in split_to_count(groups, 6)) == 8 and len(split_to_count(groups, 6)) == 6
    ranks = balanced_ranks([40, 12, 10, 9, 20, 11, 30, 14], 2)
    assert [len(r) for r in ranks] == [4, 4]
    loads = [sum([40, 12, 10, 9, 20, 11, 30, 14][i] for i in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 10


def test_config_errors_name_the_full_key():
    from megatron_grpo.config.schema import Config, from_dict

    with pytest.raises(ValueError, match="policy.dynamic_batching.max_tokens_per_microbatch"):
        from_dict(Config, {"policy": {"dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": 0}}})
    with pytest.raises(ValueError, match="policy.sequence_packing.train_mb_tokens"):
        from_dict(Config, {"policy": {"sequence_packing": {"enabled": True, "train_mb_tokens": -1}}})
    with pytest.raises(ValueError, match="policy.dynamic_batching.enabled=true needs"):
        from_dict(Config, {"policy": {"dynamic_batching": {"enabled": True},
                                      "megatron_cfg": {"pipeline_model_parallel_size": 2}}})
    with pytest.raises(ValueError, match="unknown key 'policy.sequence_packing.algorithm'"):
        from_dict(Config, {"policy": {"sequence_packing": {"algorithm": "ffd"}}})


# ---- one process ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["packed", "budget", "packed-64"])
def test_packed_and_token_budget_equal_padded(mode, tiny_dense, megatron_single):
    overrides = {"packed": PACKED, "budget": BUDGET, "packed-64": PACKED_64}[mode]
    torch.manual_seed(0)
    ref = _step(_stepper(tiny_dense, CLIP0))
    torch.manual_seed(0)
    got = _step(_stepper(tiny_dense, CLIP0, *overrides))
    _assert_same(got, ref)
    assert got["computed"] < ref["computed"]


def test_moe_packed_and_token_budget_equal_padded(tiny_moe, megatron_single):
    """Every plan, R3 and R2 replay, z-loss on: the padded path's numbers, routing metrics included."""
    routes = _moved_routes(tiny_moe)
    got = {}
    for name, overrides in MOE_MODES.items():
        torch.manual_seed(0)
        got[name] = _step(_stepper(tiny_moe, CLIP0, *overrides), routes=routes)
    _assert_moe_modes(got)


def _assert_moe_modes(got):
    """Each mode == the padded one with its replay; the replays act (R3) or find their own routes (R2)."""
    for name, result in got.items():
        ref = got["padded/R2" if name.endswith("/R2") else "padded"]
        if result is not ref:
            _assert_same(result, ref)
            assert result["computed"] < ref["computed"], name
    r3, r2 = got["padded"]["metrics"], got["padded/R2"]["metrics"]
    assert r3["moe/route_replayed_fraction"] > 0.1 and r3["moe/route_mismatch_fraction"] > 0.1
    assert 0 < r3["precision/beta_abs_mean_route_mismatch"] and 0 < r3["precision/beta_abs_mean_route_match"]
    assert r2["moe/route_replayed_fraction"] == 0.0 and r2["moe/route_mismatch_fraction"] == 0.0
    assert got["packed/R2"]["metrics"]["moe/route_replayed_fraction"] == 0.0


def test_moe_aux_loss_with_packing_names_the_keys():
    from megatron_grpo.config.schema import Config, from_dict

    for batching in ("sequence_packing", "dynamic_batching"):
        with pytest.raises(ValueError, match=f"policy.megatron_cfg.moe_aux_loss_coeff=0.01 cannot be combined with "
                                             f"policy.{batching}.enabled=true"):
            from_dict(Config, {"policy": {batching: {"enabled": True}, "megatron_cfg": {"moe_aux_loss_coeff": 0.01}}})


def test_no_token_attends_across_sequences(tiny_dense, megatron_single):
    """Changing the second sequence of a packed row leaves the first one's log-probs bitwise equal."""
    seqs = _sequences()
    st = _stepper(tiny_dense, *PACKED)
    plan = st.make_plan(_packed(seqs))
    row = next(mb for mb in plan if len(mb.seqs) >= 2)
    first, second = row.seqs.tolist()[:2]
    before = st.lowp_log_probs(_packed(seqs))
    changed = [list(s) for s in seqs]
    changed[second] = [(t * 7 + 11) % 997 + 3 for t in changed[second]]
    plan_after = st.make_plan(_packed(changed))
    assert [mb.seqs.tolist() for mb in plan_after] == [mb.seqs.tolist() for mb in plan]  # same rows
    after = st.lowp_log_probs(_packed(changed))
    assert torch.equal(before[first], after[first])
    assert not torch.equal(before[second], after[second])


# ---- several ranks ----------------------------------------------------------------------------------------


def _rank(model_dir, layout, modes, routes):
    from megatron.core import parallel_state as ps

    from megatron_grpo.parallel import state
    from megatron_grpo.trainer.step import balanced_ranks

    state.initialize_model_parallel(state.Layout(**layout))
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = torch.tensor(balanced_ranks([len(s) for s in _sequences()], dp)[r])
    out = {}
    for name, extra in modes.items():
        torch.manual_seed(0)
        st = _stepper(model_dir, CLIP0, *extra)
        st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        out[name] = dict(_step(st, rows, routes), rows=rows)
    return out


@pytest.mark.parametrize("model,layout,modes", [
    ("tiny_dense", dict(world_size=2, tp=2), {"padded": (), "packed": PACKED}),
    ("tiny_dense", dict(world_size=2), {"padded": (), "packed": PACKED_64}),
    ("tiny_dense", dict(world_size=2, pp=2), {"padded": (), "packed": PACKED}),
    ("tiny_moe", dict(world_size=2, ep=2), MOE_MODES),
    ("tiny_moe", dict(world_size=2, tp=2), MOE_MODES),
], ids=["tp2", "dp2", "pp2", "moe-ep2", "moe-tp2"])
def test_multi_rank_packed_equals_single_process(model, layout, modes, request, megatron_single):
    """TP=2 (sequence parallelism: rows a multiple of 16), DP=2 (token-balanced ranks, equal
    micro-batch counts), PP=2 (rows of one length), MoE at EP=2 (every rank's micro-batch k of one
    shape) and TP=2 with SP (routes gathered / replayed per sequence shard): each rank's padded
    step against the single-process padded step, every other mode against the padded one."""
    model_dir = request.getfixturevalue(model)
    routes = _moved_routes(model_dir) if model == "tiny_moe" else None
    torch.manual_seed(0)
    ref = _step(_stepper(model_dir, CLIP0, *modes["padded"]), routes=routes)
    for got in run_distributed(_rank, 2, model_dir, layout, modes, routes):
        for name in ("padded", "packed"):
            rows = got[name]["rows"]
            assert (got[name]["train_lp"] - ref["train_lp"][rows]).abs()[got[name]["mask"]].max().item() <= 1e-5
            for metric in ref["metrics"]:
                if metric.startswith(("precision/", "clip/", "loss/", "moe/")) or metric == "train/grad_norm":
                    assert got[name]["metrics"][metric] == pytest.approx(ref["metrics"][metric], abs=1e-6, rel=1e-5), \
                        (name, metric)
        if model == "tiny_moe":
            _assert_moe_modes(got)
        else:
            _assert_same(got["packed"], got["padded"])
