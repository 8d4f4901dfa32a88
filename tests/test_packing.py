"""models/packing.py and its use by the step: packed rows and token-budget micro-batches give the
padded path's log-probs, loss, grad norm and every precision/* and clip/* metric (fp32, 1e-6); no
token attends across sequences; THD ``PackedSeqParams`` boundaries; DP=2, TP=2 with SP, PP=2.
MoE (tiny Qwen3-MoE, z-loss on): the same plus every moe/* routing metric, with R3 (and R2) replay
laid out per packed token, in one process, at EP=2 and at TP=2 with SP."""

import weakref

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
        assert got["metrics"][name] == pytest.approx(ref["metrics"][name], abs=TOL, rel=TOL, nan_ok=True), name


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
        assert mb.mask_segments is None and mb.packed_seq_params.qkv_format == "thd"
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


def test_packing_attention_scores_and_the_log_line(caplog):
    """The issue's example, 8 sequences of 1k tokens packed into one 8k row on the local spec: 67M attention
    scores (per head and layer) against 8.4M padded; ``log_packing_cost`` says so, and not when packing is
    cheaper (short rows of a long-tailed batch)."""
    from megatron_grpo.models.forward import pack
    from megatron_grpo.models.packing import PlanSpec, attention_scores, build_plan, log_packing_cost

    assert attention_scores([(2, 10), (1, 5)]) == 2 * 100 + 25
    batch = pack([[5] * 1025] * 8, [1] * 8, 0)
    plan = build_plan(batch.input_ids, batch.labels, batch.mask, PlanSpec(packing=True, max_tokens=8192))
    assert [tuple(mb.input_ids.shape) for mb in plan] == [(1, 8192)] and batch.input_ids.shape == (8, 1032)
    with caplog.at_level("WARNING", logger="megatron_grpo.models.packing"):
        assert log_packing_cost(plan, tuple(batch.input_ids.shape))
        short = _packed()
        rows = build_plan(short.input_ids, short.labels, short.mask, PlanSpec(packing=True))
        assert not log_packing_cost(rows, tuple(short.input_ids.shape))  # rows of <= 40 tokens: cheaper
    (record,) = caplog.records
    assert "computes 67.1M attention scores per head and layer for these 8 sequences, 7.9x the 8.52M" in record.message
    assert "(8.39M per sequence)" in record.message


def test_token_budget_groups_and_equal_counts():
    from megatron_grpo.models.packing import group_by_tokens, split_to_count
    from megatron_grpo.models.packing import balanced_ranks

    groups = group_by_tokens([40, 12, 10, 9, 20, 11, 30, 14], budget=64, multiple=8)
    assert groups == [[0], [6, 4], [7, 1, 5, 2], [3]]
    assert sum(len(g) for g in split_to_count(groups, 6)) == 8 and len(split_to_count(groups, 6)) == 6
    ranks = balanced_ranks([40, 12, 10, 9, 20, 11, 30, 14], 2)
    assert [len(r) for r in ranks] == [4, 4]
    loads = [sum([40, 12, 10, 9, 20, 11, 30, 14][i] for i in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 10


def test_packed_rows_are_balanced_across_dp_ranks_by_tokens():
    """Packing alone balances DP ranks by tokens as token budgets do (before: contiguous rows, here 600 vs
    64 tokens, so one rank's rows waited for the other's at the gradient all-reduce); padded rows stay
    contiguous."""
    from megatron_grpo.models.packing import PlanSpec
    from megatron_grpo.models.packing import step_rows

    lengths = [300, 200, 60, 40, 30, 20, 8, 6]
    assert PlanSpec(packing=True).balances_tokens and PlanSpec(max_tokens=64).balances_tokens
    assert not PlanSpec().balances_tokens
    balance = PlanSpec(packing=True, max_tokens=512).balances_tokens
    rows = [step_rows(lengths, r, 2, balance) for r in range(2)]
    assert [r.tolist() for r in rows] == [[0, 4, 6, 7], [1, 2, 3, 5]]
    assert [sum(lengths[i] for i in r) for r in rows] == [344, 320]
    assert step_rows(lengths, 1, 2, PlanSpec().balances_tokens) == slice(4, 8)


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


def test_packed_masks_are_built_per_forward_and_logged_once(tiny_dense, megatron_single, monkeypatch, caplog):
    """A packed local-spec plan holds no ``[1, 1, L, L]`` mask: each row's is built when its forward runs and
    is gone before the next one's (no-grad passes and the training schedule), so a step holds one mask,
    not one per micro-batch. Rows of 120 tokens compute more scores than padding: one log line per step."""
    from megatron_grpo.models import packing

    built, alive = [], []
    make = packing.block_causal_mask

    def spy(seqlens, device=None):
        built.append(sum(m() is not None for m in alive))  # masks of earlier forwards still alive
        mask = make(seqlens, device)
        alive.append(weakref.ref(mask))
        return mask

    monkeypatch.setattr(packing, "block_causal_mask", spy)
    st = _stepper(tiny_dense, CLIP0, *PACKED, "policy.sequence_packing.train_mb_tokens=120")
    with caplog.at_level("WARNING", logger="megatron_grpo.models.packing"):
        plan = st.make_plan(_packed())
        assert built == [] and len(plan) >= 2 and all(mb.mask_segments for mb in plan)
        _step(st)  # the no-grad pass and the forward-backward
    assert len(built) == 2 * len(plan) and built == [0] * len(built)
    assert len([r for r in caplog.records if "attention scores" in r.message]) == 1


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


LONG = (256,) * 16 + (40,)
"""One packed row of 4,120 tokens: sequences at offsets 0, 255, ..., 3,825 and the short one at 4,080."""


@pytest.fixture(scope="module")
def long_rope_model(tmp_path_factory):
    """1 layer, hidden 64, head_dim 32, rope theta 1e6 (Qwen3's), weights 5x the usual init so that attention
    is sharp enough for a RoPE angle error to reach the log-probs."""
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-long-rope"), "qwen3", overrides=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, rope_theta=1.0e6, max_position_embeddings=65536, initializer_range=0.1))


def test_rope_restarts_per_sequence_in_thousands_long_packed_rows(long_rope_model, megatron_single):
    """Local spec: each packed sequence is rotated by its own positions (0, 1, ...), not by its offset in the
    row: packed == padded within 1e-5 at every completion token of a 4k-token row. Before, Megatron's RoPE
    rotated by the row position, and the fp32 rounding of the angles (o + i) * inv_freq grew with the
    offset o: 7.9e-5 at offsets near 4k (the issue measured 1.4e-3 at 8k with head_dim 128)."""
    seqs = _sequences(LONG)
    padded = _packed(seqs)
    st = _stepper(long_rope_model, *PACKED, f"policy.sequence_packing.train_mb_tokens={sum(LONG)}")
    (row,) = st.make_plan(padded, equalise=False)
    assert row.input_ids.shape[1] >= 4000 and row.mask_segments is not None
    offsets = row.gather[:, 0]  # where each sequence starts in the row
    assert offsets.max().item() > 4000 and row.position_ids[0, offsets].eq(0).all()
    got = st.lowp_log_probs(padded, torch.float32, temperature=1.0)
    ref = _stepper(long_rope_model).lowp_log_probs(padded, torch.float32, temperature=1.0)
    err = ((got - ref).abs() * padded.mask).amax(dim=1)
    assert err.max().item() <= 1e-5, err.tolist()


# ---- several ranks ----------------------------------------------------------------------------------------


def _rank(model_dir, layout, modes, routes):
    from megatron.core import parallel_state as ps

    from megatron_grpo.parallel import state
    from megatron_grpo.models.packing import balanced_ranks

    state.initialize_model_parallel(state.Layout(**layout))
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = torch.tensor(balanced_ranks([len(s) for s in _sequences()], dp)[r])
    out = {}
    for name, extra in modes.items():
        torch.manual_seed(0)
        st = _stepper(model_dir, CLIP0, *extra)
        st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        if dp > 1 and st.plan_spec.balances_tokens:  # the step's own DP rows (packing alone too): by tokens
            own = st.score_layout([len(s) for s in _sequences()], _packed())[0]
            assert torch.arange(len(LENGTHS))[own].tolist() == rows.tolist(), name
        out[name] = dict(_step(st, rows, routes), rows=rows)
        if dp > 1 and name == "packed" and st.routing is None:
            out["probe"] = _megatron_engine_scores(model_dir, st)
    return out


def _megatron_engine_scores(model_dir, st):
    """The megatron generator scoring in the step's layout over DP (``score_layout``), as the parity probe
    asks it: 3 sequences, which DP = 2 does not divide (a step's rows always are)."""
    from megatron_grpo.rollout.engines.megatron_engine import MegatronEngine

    engine = MegatronEngine(model_dir, torch.float32, model=st.model, score_layout=st.score_layout,
                            score_group=st.dp_group)
    return engine.score(_sequences()[:3], [PROMPT] * 3)


@pytest.mark.parametrize("model,layout,modes", [
    ("tiny_dense", dict(world_size=2, tp=2), {"padded": (), "packed": PACKED}),
    ("tiny_dense", dict(world_size=2), {"padded": (), "packed": PACKED, "packed-64": PACKED_64}),
    ("tiny_dense", dict(world_size=2, pp=2), {"padded": (), "packed": PACKED}),
    ("tiny_moe", dict(world_size=2, ep=2), MOE_MODES),
    ("tiny_moe", dict(world_size=2, tp=2), MOE_MODES),
], ids=["tp2", "dp2", "pp2", "moe-ep2", "moe-tp2"])
def test_multi_rank_packed_equals_single_process(model, layout, modes, request, megatron_single):
    """TP=2 (sequence parallelism: rows a multiple of 16), DP=2 (packed alone and with a token budget:
    token-balanced ranks, equal micro-batch counts), PP=2 (rows of one length), MoE at EP=2 (every rank's
    micro-batch k of one shape) and TP=2 with SP (routes gathered / replayed per sequence shard): each rank's padded
    step against the single-process padded step, every other mode against the padded one."""
    model_dir = request.getfixturevalue(model)
    routes = _moved_routes(model_dir) if model == "tiny_moe" else None
    torch.manual_seed(0)
    ref = _step(_stepper(model_dir, CLIP0, *modes["padded"]), routes=routes)
    for got in run_distributed(_rank, 2, model_dir, layout, modes, routes):
        for name in ("padded", "packed") if model == "tiny_moe" else modes:
            rows = got[name]["rows"]
            assert (got[name]["train_lp"] - ref["train_lp"][rows]).abs()[got[name]["mask"]].max().item() <= 1e-5
            for metric in ref["metrics"]:
                if metric.startswith(("precision/", "clip/", "loss/", "moe/")) or metric == "train/grad_norm":
                    assert got[name]["metrics"][metric] == pytest.approx(ref["metrics"][metric], abs=1e-6, rel=1e-5,
                                                                          nan_ok=True), \
                        (name, metric)
        if model == "tiny_moe":
            _assert_moe_modes(got)
        for name in () if model == "tiny_moe" else set(modes) - {"padded"}:
            _assert_same(got[name], got["padded"])
        if "probe" in got:  # every sequence scored (before: the third got None), the single-process numbers
            packed = _packed()
            expected = [row[m].tolist() for row, m in zip(ref["lp"][:3], packed.mask[:3])]
            assert [len(row) for row in got["probe"]] == [len(row) for row in expected]
            assert max(abs(a - b) for r, e in zip(got["probe"], expected) for a, b in zip(r, e)) <= 1e-5
