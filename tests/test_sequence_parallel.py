"""Sequence parallelism (on by default at TP > 1): TP=2 logits, log-probs, reduced gradients (norm
weights included), a MoE training step with R3 replay, the routing record and the MoE aux / z losses on
a width SP pads equal one process's;
MoE with TP > 1 and ``sequence_parallel: false`` is refused naming the key."""

import pytest
import torch

from tests._dist import run_distributed
from tests.test_routing import PROMPT, RECIPE, ROWS, SEQ, _metrics, _sequences, _step_batch, _stepper

ODD = 23
"""A sequence length that is not a multiple of TP: ``forward_logits`` pads it under SP."""
MOE_LOSSES = ("policy.megatron_cfg.moe_aux_loss_coeff=0.5", "policy.megatron_cfg.moe_z_loss_coeff=0.5")


def _groups(st):
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    return st


def _reduced_grads(st, batch=None):
    """One forward-backward of ``batch`` (default: the whole batch), reduced by ``finalize_model_grads``:
    the full gradient under HF names (TP shards gathered like weights) and Megatron's global grad norm."""
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.models.weights import export_hf_tensors

    st.current_step, st.nonfinite = 0, []
    st.optimizer.zero_grad()
    batch = batch or _step_batch(torch.full((ROWS, SEQ), -7.0), torch.linspace(-1.0, 1.0, ROWS))
    st.forward_backward(batch, None, None)
    st.optimizer.megatron.prepare_grads()
    norm = float(st.optimizer.megatron.get_grad_norm())
    saved = [p.detach().clone() for p in st.optimizer.params]
    with torch.no_grad():
        for p in st.optimizer.params:
            p.copy_(p.main_grad)
    shape = shape_from_hf(load_hf_config(st.cfg.policy.model_name))
    grads = {k: v.clone() for k, v in export_hf_tensors(st.model, shape, include_tied_lm_head=False)}
    with torch.no_grad():
        for p, w in zip(st.optimizer.params, saved):
            p.copy_(w)
    st.optimizer.zero_grad()
    return grads, norm


def _odd_batch(sp):
    """The sequences cut to ``ODD`` tokens, a batch ``ODD`` wide: under SP ``forward_logits`` pads each
    row by repeating its last id, and the MoE routers route that position too; without SP the same
    column is appended here, outside every loss token, so that both runs route the same tokens."""
    from megatron_grpo.models.forward import PackedBatch, pack
    from megatron_grpo.trainer.step import StepBatch

    p = pack([s[:ODD] for s in _sequences()], [PROMPT] * ROWS, 0, pad_to_multiple=1)
    assert p.input_ids.shape == (ROWS, ODD)
    if not sp:
        pad = torch.zeros_like(p.mask[:, :1])
        p = PackedBatch(torch.cat([p.input_ids, p.input_ids[:, -1:]], 1), torch.cat([p.labels, pad.long()], 1),
                        torch.cat([p.mask, pad], 1))
    old = torch.full(p.labels.shape, -7.0)
    return StepBatch(p, old, torch.linspace(-1.0, 1.0, ROWS), p.mask.sum().double(), p.mask.any(-1).sum().double())


def _logits(st):
    """Full-vocabulary logits of an odd-length batch (padded to a multiple of TP inside)."""
    from megatron_grpo.models import forward_logits
    from megatron_grpo.parallel import comm

    ids = torch.tensor([s[:ODD] for s in _sequences()[:2]])
    with torch.no_grad():
        return comm.all_gather_cat(forward_logits(st.model, ids), -1, st.tp_group)


def _results(dense, moe, old, adv, routes):
    """Dense: logits, log-probs, reduced grads. MoE (aux + z losses, R3): the routing record of a
    no-grad forward, reduced grads, one training step replaying ``routes``, log-probs after it."""
    from megatron_grpo.models.forward import pack
    from megatron_grpo.models import unwrap

    packed = pack(_sequences(), [PROMPT] * ROWS, 0)
    st = _groups(_stepper(dense))
    out = {"sp": unwrap(st.model).config.sequence_parallel, "logits": _logits(st),
           "log_probs": st.lowp_log_probs(packed), "grads": _reduced_grads(st)}
    st = _groups(_stepper(moe, "policy.megatron_cfg.moe_routing_replay=R3", *MOE_LOSSES, moe_aux_loss_coeff=0.5,
                          moe_z_loss_coeff=0.5))
    st.lowp_log_probs(packed)
    out["moe_sp"] = unwrap(st.model).config.sequence_parallel
    out["routes"] = st.routing.take(packed.input_ids.shape[1], "natural")
    with st.routing.forward():
        out["moe_logits"] = _logits(st)
    out["odd_routes"] = st.routing.take(ODD, "natural")  # a length padded for the forward
    out["moe_grads"] = _reduced_grads(st)
    out["odd_moe_grads"] = _reduced_grads(st, _odd_batch(out["moe_sp"]))  # aux + z losses over padded rows
    out["moe_step"] = _metrics(st, _step_batch(old, adv, routes=routes))
    out["moe_after"] = st.lowp_log_probs(packed)
    return out


def _tp2_rank(dense, moe, old, adv, routes):
    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=2, tp=2))
    return _results(dense, moe, old, adv, routes)


def _moved_routes(natural):
    """R3 routes: the fp32 generator's own routing, layer 1's completion positions moved to (0, 3)."""
    from megatron_grpo.models.routing import generator_routes
    from megatron_grpo.rollout import Rollout

    moved = natural.clone()
    moved[:, PROMPT - 1:, 0] = torch.tensor([0, 3], dtype=moved.dtype)
    rollouts = [Rollout(0, s[:PROMPT], s[PROMPT:], [], "stop", 0, routed_experts=moved[i, : len(s) - 1].numpy())
                for i, s in enumerate(_sequences())]
    return generator_routes(rollouts, natural.shape[1])


def _close_grads(got, ref, rel):
    (grads, norm), (ref_grads, ref_norm) = got, ref
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        err = ((grads[name] - g).norm() / g.norm().clamp(min=1e-30)).item()
        assert err < rel, (name, err)


def test_tp2_sequence_parallel_matches_one_process(tiny_dense, tiny_moe, megatron_single):
    from megatron_grpo.models.forward import pack

    st = _stepper(tiny_moe)
    old = st.lowp_log_probs(pack(_sequences(), [PROMPT] * ROWS, 0))
    routes = _moved_routes(st.routing.take(SEQ, "natural"))
    adv = torch.linspace(-1.0, 1.0, ROWS)
    ref = _results(tiny_dense, tiny_moe, old, adv, routes)
    assert not ref["sp"] and not ref["moe_sp"]
    for got in run_distributed(_tp2_rank, 2, tiny_dense, tiny_moe, old, adv, routes):
        assert got["sp"] and got["moe_sp"]  # the default at TP = 2
        for key, tol in (("logits", 1e-4), ("moe_logits", 1e-4), ("log_probs", 1e-5)):
            assert got[key].shape == ref[key].shape
            assert (got[key] - ref[key]).abs().max().item() <= tol, key
        # every norm weight (input, pre-MLP, QK, final) summed over the TP ranks' sequence shards
        assert any("layernorm" in n for n in ref["grads"][0]) and "model.norm.weight" in ref["grads"][0]
        _close_grads(got["grads"], ref["grads"], 1e-5)
        _close_grads(got["moe_grads"], ref["moe_grads"], 1e-5)  # router, experts, aux + z losses
        # an odd width: the aux / z losses count the position SP pads each row with (exact reference:
        # one process routes the same 8 x 24 tokens, the padding column appended by hand)
        _close_grads(got["odd_moe_grads"], ref["odd_moe_grads"], 1e-5)
        # the record covers every position, in order: each TP rank holds the whole [B, S, L, k]
        assert torch.equal(got["routes"], ref["routes"]) and torch.equal(got["odd_routes"], ref["odd_routes"])
        step, ref_step = got["moe_step"], ref["moe_step"]
        assert ref_step["moe/route_replayed_fraction"] > 0.2  # the replay (scattered to each shard) acted
        for name in ("moe/route_replayed_fraction", "moe/route_mismatch_fraction", "moe/tokens_any_mismatch",
                     "loss/policy", "policy/kl_rollout", "train/grad_norm"):
            assert step[name] == pytest.approx(ref_step[name], rel=1e-4, abs=1e-7), name
        assert (got["moe_after"] - ref["moe_after"]).abs().max().item() <= 1e-5  # the same update


def test_moe_with_tp2_refuses_sequence_parallel_false(tiny_moe, tiny_dense, capsys):
    from megatron_grpo.trainer import launch, layout
    from megatron_grpo.models.qwen3 import load_hf_config, resolve_sequence_parallel, shape_from_hf
    from megatron_grpo.config.recipe import load_recipe

    moe, dense = (shape_from_hf(load_hf_config(d)) for d in (tiny_moe, tiny_dense))
    assert resolve_sequence_parallel(None, 2, moe) and not resolve_sequence_parallel(None, 1, moe)
    assert not resolve_sequence_parallel(False, 2, dense) and not resolve_sequence_parallel(True, 1, dense)
    with pytest.raises(ValueError, match=r"policy\.megatron_cfg\.sequence_parallel=false with a MoE model"):
        resolve_sequence_parallel(False, 2, moe)
    overrides = [f"policy.model_name={tiny_moe}", "policy.megatron_cfg.tensor_model_parallel_size=2",
                 "policy.megatron_cfg.sequence_parallel=false"]
    with pytest.raises(ValueError, match=r"policy\.megatron_cfg\.sequence_parallel=false"):
        layout.describe_layout(load_recipe(RECIPE, overrides), 2)  # the dry run stops
    assert launch.main(RECIPE, overrides, dry_run=True, world_size=2) == 2
    assert "sequence_parallel=false with a MoE model" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"policy\.megatron_cfg\.sequence_parallel: expected bool"):
        load_recipe(RECIPE, ["policy.megatron_cfg.sequence_parallel=sometimes"])

