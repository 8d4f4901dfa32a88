"""MoE routing: the top-k tap, router precision, routing-mismatch metrics, R2/R3 replay, EP=2."""

import os

import pytest
import torch

from tests._dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")
ROWS, PROMPT, SEQ = 8, 8, 24


@pytest.fixture(scope="module")
def near_tie_moe(tmp_path_factory):
    """The tiny Qwen3-MoE with, in every layer, expert 2's gate row = expert 1's + 1e-4 noise:
    whenever the top-2 boundary falls between them, the choice rests on a tiny logit gap
    that bf16 rounding can flip (the fp32 trainer and a bf16 generator then disagree)."""
    from safetensors.torch import load_file, save_file

    from megatron_grpo.models.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("models") / "near-tie-moe"), "qwen3-moe")
    weights_file = os.path.join(path, "model.safetensors")
    weights = load_file(weights_file)
    noise = torch.Generator().manual_seed(1)
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        gate = weights[name]
        gate[2] = gate[1] + 1e-4 * torch.randn(gate.shape[1], generator=noise)
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


def _stepper(model_dir, *overrides, with_ref=False, **build):
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.trainer.optim import Optimizer, wrap_model
    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.trainer.step import TrainStep

    cfg = load_recipe(RECIPE, [f"policy.model_name={model_dir}", "grpo.deployed_improvement=false",
                               "policy.train_micro_batch_size=4", *overrides])
    model, _ = build_from_hf(model_dir, **dict(dict(fp8_recipe=cfg.policy.precision.fp8.recipe()), **build))
    ref = build_from_hf(model_dir)[0].requires_grad_(False) if with_ref else None
    model = wrap_model(model, cfg)
    return TrainStep(model, Optimizer(model, cfg), cfg, None, None, ref)


def _sequences():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (SEQ - i % 3,), generator=g).tolist() for i in range(ROWS)]


def _step_batch(old, advantages, rows=slice(None), routes=None):
    from megatron_grpo.models.forward import pack
    from megatron_grpo.trainer.step import StepBatch

    packed = pack(_sequences(), [PROMPT] * ROWS, 0)
    return StepBatch(packed.rows(rows), old[rows], advantages[rows], packed.mask.sum().double(),
                     packed.mask.any(-1).sum().double(), None if routes is None else routes[rows])


def _generator_view(model_dir, generation_dtype="bfloat16", *overrides):
    """Old log-probs and advantages: the generator's precision emulated by a shadow forward."""
    from megatron_grpo.models.forward import pack

    st = _stepper(model_dir, f"policy.precision.generation_dtype={generation_dtype}", *overrides)
    old = st.lowp_log_probs(pack(_sequences(), [PROMPT] * ROWS, 0))
    return old, torch.linspace(-1.0, 1.0, ROWS)


def _metrics(st, batch):
    from megatron_grpo.loss import finalize

    stats, extra = st.run(batch)
    metrics = {k: v.item() for k, v in finalize(*stats.reduce(st.dp_group)).items()}
    return dict(metrics, **{k: v.item() for k, v in extra.items()})


def test_tap_records_and_replays_through_megatrons_topk(megatron_single):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from megatron_grpo.models.routing import RouteTap, from_router_order, same_experts, to_router_order

    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    tap = RouteTap()
    probs, routing_map = topk_routing_with_score_function(logits, 2, router_replay=tap)
    assert tap.natural == [] and routing_map.sum() == 12  # not recording: a pass-through
    tap.recording = True
    topk_routing_with_score_function(logits, 2, router_replay=tap)
    natural = tap.natural[0].long()
    target = torch.tensor([[0, 1]] * 3 + [[-1, -1]] * 3)
    tap.replay = True
    tap.targets.append(target)
    probs, routing_map = topk_routing_with_score_function(logits, 2, router_replay=tap)
    expected = torch.where(target < 0, natural, target)
    assert routing_map.nonzero()[:, 1].view(6, 2).tolist() == expected.sort(-1).values.tolist()
    # the weights of the replayed experts: softmax over their logits (renormalised top-k)
    want = torch.softmax(logits.gather(1, expected), dim=-1)
    torch.testing.assert_close(probs.gather(1, expected), want)
    probs.sum().backward()
    assert logits.grad is not None  # the router still learns under replay
    assert same_experts(tap.used[-1], expected.to(tap.used[-1].dtype)).all()
    routes = torch.arange(2 * 3 * 2).view(2, 3, 2)  # [b, s, k]
    assert torch.equal(from_router_order(to_router_order(routes), 3), routes)


def test_fp32_matched_moe_has_zero_routing_mismatch_and_skips_the_shadow(tiny_moe, megatron_single):
    old, adv = _generator_view(tiny_moe, "float32")
    st = _stepper(tiny_moe, "loss_fn.reference_policy_kl_penalty=0.1", with_ref=True)
    assert not st.needs_shadow
    m = _metrics(st, _step_batch(old, adv))
    assert m["policy/kl_ref"] == 0.0  # the reference (same weights, same router precision) equals the policy
    for name in ("moe/route_mismatch_fraction", "moe/tokens_any_mismatch", "moe/route_replayed_fraction",
                 "precision/beta_abs_mean", "precision/beta_abs_mean_route_match"):
        assert m[name] == 0.0, name


def test_bf16_generator_near_ties_mismatch_and_r2_replay_removes_it(near_tie_moe, megatron_single):
    old, adv = _generator_view(near_tie_moe)
    off = _metrics(_stepper(near_tie_moe, "policy.precision.generation_dtype=bfloat16"), _step_batch(old, adv))
    assert off["moe/route_mismatch_fraction"] > 0.01 and off["moe/tokens_any_mismatch"] > 0.02
    assert off["moe/route_replayed_fraction"] == 0.0
    # a token routed to a different expert carries a larger precision gap
    assert off["precision/beta_abs_mean_route_mismatch"] > 2 * off["precision/beta_abs_mean_route_match"] > 0
    r2 = _metrics(_stepper(near_tie_moe, "policy.precision.generation_dtype=bfloat16", "grpo.grad_cos_clean_every=1",
                           "policy.megatron_cfg.moe_routing_replay=R2"), _step_batch(old, adv))
    # nothing clipped: the PPO gradient is the REINFORCE gradient under the same (replayed) routing
    assert r2["clip/region_fraction"] == 0.0 and r2["grad/cos_clean"] == pytest.approx(1.0, abs=1e-5)
    assert r2["moe/route_mismatch_fraction"] == 0.0 and r2["moe/tokens_any_mismatch"] == 0.0
    assert r2["precision/beta_abs_mean_route_mismatch"] == 0.0
    assert r2["moe/route_replayed_fraction"] > 0.01  # the replay overrode the trainer's own choices
    assert r2["precision/beta_abs_mean"] < 0.6 * off["precision/beta_abs_mean"]
    assert r2["precision/beta_abs_mean"] == r2["precision/beta_abs_mean_route_match"]


def test_shadow_uses_the_generators_router_precision(near_tie_moe, megatron_single):
    # bf16 everywhere but the trainer's fp32 router: the shadow still runs (vLLM's gate is bf16)
    st = _stepper(near_tie_moe, "policy.precision.compute_dtype=bfloat16")
    assert st.needs_shadow and st.routing.shadow_dtype == torch.bfloat16
    assert st.routing.train_dtype == torch.float32
    same = _stepper(near_tie_moe, "policy.precision.compute_dtype=bfloat16",
                    "policy.precision.shadow_router_dtype=float32")
    assert not same.needs_shadow


FP8 = ("policy.precision.generation_dtype=fp8", "policy.precision.fp8.weight_block_size=[32,32]",
       "policy.precision.fp8.activation_block_size=32")
"""An fp8 generator with the tiny models' blocks (the shadow follows it: shadow_dtype null)."""


def test_fp8_shadow_routers_stay_bf16_and_r2_replays_its_routing(near_tie_moe, megatron_single):
    """The fp8 shadow's routers run in bf16 (vLLM's fp8 models keep the gate in bf16; only the experts' and the
    attention's linears are FP8); its routing differs from the fp32 trainer's at near ties, and R2 replays it."""
    from megatron_grpo.models import fp8, unwrap

    old, adv = _generator_view(near_tie_moe, *FP8[0].split("=")[1:], *FP8[1:])  # the fp8 shadow's own
    off_st = _stepper(near_tie_moe, *FP8)
    assert off_st.needs_shadow and off_st.routing.shadow_dtype == torch.bfloat16
    gates = [n for n, _ in fp8.fp8_linears(unwrap(off_st.model), off_st.cfg.policy.precision.fp8.recipe())]
    assert gates and not any("router" in n for n in gates)
    off = _metrics(off_st, _step_batch(old, adv))
    assert off["precision/alpha_abs_mean"] == 0.0  # the generator view is this fp8 shadow
    assert off["moe/route_mismatch_fraction"] > 0.01 and off["precision/beta_abs_mean"] > 5e-3
    r2 = _metrics(_stepper(near_tie_moe, *FP8, "policy.megatron_cfg.moe_routing_replay=R2"), _step_batch(old, adv))
    assert r2["moe/route_mismatch_fraction"] == 0.0 and r2["moe/route_replayed_fraction"] > 0.01
    assert r2["precision/alpha_abs_mean"] == 0.0


def test_r3_replays_the_generators_routing(near_tie_moe, megatron_single):
    from megatron_grpo.models.forward import pack
    from megatron_grpo.models.routing import generator_routes
    from megatron_grpo.rollout import Rollout

    st = _stepper(near_tie_moe, "policy.megatron_cfg.moe_routing_replay=R3")
    packed = pack(_sequences(), [PROMPT] * ROWS, 0)
    old = st.lowp_log_probs(packed)  # an fp32 generator: its routing is the trainer's own
    natural = st.routing.take(packed.input_ids.shape[1])
    adv = torch.linspace(-1.0, 1.0, ROWS)

    def rollouts(routes):
        # vLLM's layout: [positions forwarded (prompt + completion - 1), layers, k]
        return [Rollout(0, s[:PROMPT], s[PROMPT:], [], "stop", 0, routed_experts=routes[i, : len(s) - 1].numpy())
                for i, s in enumerate(_sequences())]

    same = generator_routes(rollouts(natural), packed.input_ids.shape[1])
    m = _metrics(st, _step_batch(old, adv, routes=same))
    assert m["moe/route_replayed_fraction"] == 0.0 and m["policy/kl_rollout"] < 1e-10
    torch.testing.assert_close(st.last_log_probs[0], old)
    # a generator that routed every completion position of layer 1 to experts (0, 3)
    moved = natural.clone()
    moved[:, PROMPT - 1 :, 0] = torch.tensor([0, 3], dtype=moved.dtype)
    st = _stepper(near_tie_moe, "policy.megatron_cfg.moe_routing_replay=R3")
    m = _metrics(st, _step_batch(old, adv, routes=generator_routes(rollouts(moved), packed.input_ids.shape[1])))
    assert m["moe/route_replayed_fraction"] > 0.2 and m["policy/kl_rollout"] > 0


def test_r3_without_routes_and_misuse_name_the_key(tiny_dense, near_tie_moe, megatron_single):
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.trainer.layout import check_moe_options

    st = _stepper(near_tie_moe, "policy.megatron_cfg.moe_routing_replay=R3")
    old, adv = torch.zeros(ROWS, SEQ), torch.ones(ROWS)
    with pytest.raises(ValueError, match="moe_routing_replay=R3: the rollouts carry no routed experts"):
        st.run(_step_batch(old, adv))
    with pytest.raises(ValueError, match="moe_routing_replay=R2 needs a MoE model"):
        _stepper(tiny_dense, "policy.megatron_cfg.moe_routing_replay=R2")
    cfg = load_recipe(RECIPE, [f"policy.model_name={near_tie_moe}", "policy.megatron_cfg.moe_routing_replay=R3"])
    shape = shape_from_hf(load_hf_config(near_tie_moe))
    check_moe_options(cfg, shape)  # a dry run on CPU accepts it
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use R2 on CPU"):
            check_moe_options(cfg, shape, runtime=True)
    with pytest.raises(ValueError, match="moe_routing_replay must be none, R2 or R3"):
        load_recipe(RECIPE, ["policy.megatron_cfg.moe_routing_replay=R4"])


def _ep2_worker(model_dir, old, adv):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=2, ep=2))
    st = _stepper(model_dir, "policy.precision.generation_dtype=bfloat16")
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    rank = dist.get_rank()
    return _metrics(st, _step_batch(old, adv, rows=slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)))


def test_ep2_routing_metrics_match_single_process(near_tie_moe, megatron_single):
    old, adv = _generator_view(near_tie_moe)
    single = _metrics(_stepper(near_tie_moe, "policy.precision.generation_dtype=bfloat16"), _step_batch(old, adv))
    for metrics in run_distributed(_ep2_worker, 2, near_tie_moe, old, adv):
        for name in ("moe/route_mismatch_fraction", "moe/tokens_any_mismatch", "precision/beta_abs_mean",
                     "precision/beta_abs_mean_route_mismatch", "loss/policy", "clip/region_fraction"):
            assert metrics[name] == pytest.approx(single[name], abs=1e-6, rel=1e-4), name


def _router_grad(model_dir, rows, coeffs):
    """Router gradient of one forward-backward over ``_sequences()`` repeated ``rows // ROWS`` times."""
    from megatron_grpo.models.forward import pack
    from megatron_grpo.trainer.step import StepBatch

    st = _stepper(model_dir, *[f"policy.megatron_cfg.{k}={v}" for k, v in coeffs.items()], **coeffs)
    st.current_step, st.nonfinite = 0, []
    packed = pack(_sequences() * (rows // ROWS), [PROMPT] * rows, 0)
    old, adv = torch.full(packed.labels.shape, -7.0), torch.linspace(-1.0, 1.0, ROWS).repeat(rows // ROWS)
    batch = StepBatch(packed, old, adv, packed.mask.sum().double(), packed.mask.any(-1).sum().double())
    st.optimizer.zero_grad()
    st.forward_backward(batch, None, None)
    return [p.main_grad.clone() for n, p in st.model.named_parameters() if "router" in n]


@pytest.mark.parametrize("coeffs", [dict(moe_z_loss_coeff=0.5), dict(moe_aux_loss_coeff=0.5)], ids=["z", "aux"])
def test_moe_aux_losses_are_means_over_the_steps_tokens(coeffs, tiny_moe, megatron_single):
    # the policy loss is a token mean, so repeating the batch leaves every gradient unchanged;
    # the aux/z losses must be means as well (Megatron's per-token scaling would double them)
    once, twice = _router_grad(tiny_moe, ROWS, coeffs), _router_grad(tiny_moe, 2 * ROWS, coeffs)
    without = _router_grad(tiny_moe, ROWS, {})
    for a, b, c in zip(once, twice, without):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
        assert (a - c).norm() > 0.1 * c.norm()  # the aux loss does act
