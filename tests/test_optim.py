"""Megatron-Core's DDP + optimizer through the trainer: the distributed optimizer at DP=2 equals one
process and halves the state per rank, torch's fused CPU AdamW equals its loop, the CPU weight-gradient
accumulation fusion equals the unfused gradients, bf16 (master weights) and fp16 (loss scaling) params train,
``master_weights=false`` loses updates below half a bf16 ulp, the LR schedule, config errors."""

import math

import pytest
import torch

from tests._dist import run_distributed
from tests.test_routing import RECIPE, ROWS, SEQ, _step_batch, _stepper

STEPS = 3
BF16 = ("policy.precision.params_dtype=bfloat16", "policy.precision.compute_dtype=bfloat16")


def _train(model_dir, *overrides, steps=STEPS, **build):
    """``steps`` x (forward-backward of this DP rank's half of a fixed batch -> ``Optimizer.step``);
    returns the parameters, the per-step losses / results, the optimizer state bytes and DDP's padding."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.loss import finalize

    st = _stepper(model_dir, *overrides, **build)
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    old, adv = torch.full((ROWS, SEQ), -7.0), torch.linspace(-1.0, 1.0, ROWS)
    batch = _step_batch(old, adv, rows=slice(rank * ROWS // dp, (rank + 1) * ROWS // dp))
    initial = [p.detach().float().clone() for p in st.optimizer.params]
    losses, results = [], []
    for step in range(steps):
        st.current_step, st.nonfinite = step, []
        st.optimizer.zero_grad()
        stats, _ = st.forward_backward(batch, None, None)
        losses.append(finalize(*stats.reduce(st.dp_group))["loss/policy"].item())
        results.append({k: v.item() for k, v in st.optimizer.step().items()})
    buffers = st.model.buffers + st.model.expert_parallel_buffers
    padding = sum(b.grad_data.numel() for b in buffers) - sum(p.numel() for p in st.optimizer.params)
    params = {n: p.detach().float().clone() for n, p in st.model.named_parameters()}
    moved = max((p.detach().float() - q).abs().max().item() for p, q in zip(st.optimizer.params, initial))
    return dict(params=params, losses=losses, results=results, state_bytes=st.optimizer.state_bytes(),
                padding=padding, moved=moved, optimizer=st.optimizer)


def _dp2_worker(model_dir):
    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=2))
    out = _train(model_dir, "policy.megatron_cfg.optimizer.use_distributed_optimizer=true")
    assert type(out.pop("optimizer").chained[0]).__name__ == "DistributedOptimizer"
    return out


def test_distributed_optimizer_at_dp2_equals_one_process_with_half_the_state(tiny_dense, megatron_single):
    single = _train(tiny_dense)
    assert single.pop("padding") == 0  # the replicated optimizer's buffers are not padded
    ranks = run_distributed(_dp2_worker, 2, tiny_dense)
    for out in ranks:
        assert out["losses"] == pytest.approx(single["losses"], abs=1e-6)
        for a, b in zip(out["results"], single["results"]):
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
        for name, p in single["params"].items():
            torch.testing.assert_close(out["params"][name], p, atol=1e-6, rtol=0, msg=name)
    assert single["moved"] > 1e-3  # 3 steps at the tiny recipe's lr = 2e-3 moved the weights
    # the state is split between the ranks; DDP's padding (256 elements here, 0.02%: each 32-element q/k
    # norm ends 32 short of the next 64-element start) only moves the split point, so each rank holds half
    # within 8 B x padding (exactly half here: 4,199,936 B each of 8,399,872)
    half, padding = single["state_bytes"] / 2, ranks[0]["padding"]
    assert sum(out["state_bytes"] for out in ranks) == single["state_bytes"]
    assert 0 < padding <= 0.001 * sum(p.numel() for p in single["params"].values())
    for out in ranks:
        assert abs(out["state_bytes"] - half) <= 8 * padding


def test_megatrons_cpu_adamw_runs_torchs_fused_kernel_with_the_loops_updates(tiny_dense, megatron_single,
                                                                             monkeypatch):
    """Without TE / Apex Megatron-Core builds torch's AdamW; on CPU ``parallel.cpu.fuse_torch_adam`` switches
    it to torch's fused kernel (3 steps: the same weights as the per-tensor loop, to fp32 round-off)."""
    fused = _train(tiny_dense)
    assert all(g["fused"] and not g["foreach"] for g in fused["optimizer"].chained[0].optimizer.param_groups)
    monkeypatch.setattr("megatron_grpo.trainer.optim.fuse_torch_adam", lambda optimizers: 0)
    loop = _train(tiny_dense)
    assert not any(g["fused"] for g in loop["optimizer"].chained[0].optimizer.param_groups)
    assert loop["moved"] > 1e-3
    for name, p in loop["params"].items():
        torch.testing.assert_close(fused["params"][name], p, atol=2e-6, rtol=0, msg=name)


def _grads(model_dir, *overrides, **build):
    """DDP's gradient buffers (and the layers running the fused weight-gradient path) after one
    forward-backward of 8 rows in 2 micro-batches."""
    st = _stepper(model_dir, *overrides, **build)
    st.current_step, st.nonfinite = 1, []
    st.optimizer.zero_grad()
    old, adv = torch.full((ROWS, SEQ), -7.0), torch.linspace(-1.0, 1.0, ROWS)
    st.forward_backward(_step_batch(old, adv), None, None)
    fused = sorted(n for n, m in st.model.named_modules() if getattr(m, "gradient_accumulation_fusion", False))
    return {n: p.main_grad.float().clone() for n, p in st.model.named_parameters()}, fused


@pytest.mark.parametrize("model, precision", [("tiny_dense", "float32"), ("tiny_tied", "float32"),
                                              ("tiny_dense", "bf16-autocast"), ("tiny_dense", "bfloat16")])
def test_cpu_wgrad_accumulation_fusion_equals_the_unfused_gradients(model, precision, request, megatron_single,
                                                                    monkeypatch):
    """``parallel.cpu.fuse_wgrad_accumulation``: Megatron's gradient_accumulation_fusion path with a CPU kernel
    gives DDP's buffers the unfused path's gradients (2 micro-batches accumulated; fp32 to round-off; bf16
    compute, with fp32 or bf16 params, to a bf16 ulp); a tied output layer keeps the unfused path, so the
    embedding's own gradient (through the same parameter) is still counted."""
    model_dir = request.getfixturevalue(model)
    overrides, build = [], {}
    if precision != "float32":
        overrides = ["policy.precision.compute_dtype=bfloat16"]
    if precision == "bfloat16":
        overrides.append("policy.precision.params_dtype=bfloat16")
        build = {"params_dtype": torch.bfloat16}
    fused, names = _grads(model_dir, *overrides, **build)
    monkeypatch.setattr("megatron_grpo.trainer.optim.fuse_wgrad_accumulation", lambda model: 0)
    loop, unfused_names = _grads(model_dir, *overrides, **build)
    assert not unfused_names
    assert any(n.endswith("linear_fc1") for n in names) and any(n.endswith("linear_qkv") for n in names)
    assert any(n.endswith("output_layer") for n in names) == (model == "tiny_dense"), names
    tol = 1e-6 if precision == "float32" else 1e-2
    for name, g in loop.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(fused[name], g, atol=tol * g.abs().max().item(), rtol=0, msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_params_train_through_megatrons_optimizer(dtype, tiny_dense, megatron_single):
    """bf16 params: fp32 main params, no loss scale; fp16 params: fp32 main params + dynamic loss scaling."""
    out = _train(tiny_dense, f"policy.precision.params_dtype={dtype}", f"policy.precision.compute_dtype={dtype}",
                 steps=4, params_dtype=getattr(torch, dtype))
    opt = out["optimizer"]
    assert type(opt.chained[0]).__name__ == "Float16OptimizerWithFloat16Params"
    assert all(p.dtype == getattr(torch, dtype) and p.main_param.dtype == torch.float32 for p in opt.params)
    assert opt.has_loss_scaler == (dtype == "float16")
    assert not any(r["train/skipped_nonfinite"] for r in out["results"])
    applied = [not r["train/skipped_overflow"] for r in out["results"]]
    assert sum(applied) >= 3, out["results"]
    assert out["losses"][-1] < out["losses"][0] - 0.01, out["losses"]


def _fill_and_step(opt, value, steps):
    for _ in range(steps):
        for b in opt.model.buffers + opt.model.expert_parallel_buffers:
            b.grad_data.fill_(value)
        out = opt.step()
        assert out["train/skipped_nonfinite"].item() == 0
    return out


def test_bf16_without_master_weights_loses_updates_below_half_an_ulp(tiny_dense, megatron_single):
    """The write-up's DTYPE=bfloat16 effect: Adam's first steps move every weight by ~lr; at lr = 1e-3 the
    RMSNorm weights (1.0, half a bf16 ulp below = 2^-9 = 0.00195) never move with master_weights=false,
    while fp32 main params accumulate the steps and the bf16 weights follow (1 - 3e-3 -> 0.99609375)."""
    norms = {}
    for master in (False, True):
        st = _stepper(tiny_dense, *BF16, f"policy.precision.master_weights={str(master).lower()}",
                      "policy.megatron_cfg.optimizer.lr=1e-3", "policy.megatron_cfg.optimizer.clip_grad=0",
                      params_dtype=torch.bfloat16)
        opt = st.optimizer
        named = dict(st.model.named_parameters())
        norm_names = [n for n in named if n.endswith("layernorm.weight")]  # input / pre-MLP / q / k / final
        assert norm_names and all(bool((named[n] == 1).all()) for n in norm_names)
        before = {n: p.detach().clone() for n, p in named.items()}
        _fill_and_step(opt, 1e-3, 3)
        norms[master] = torch.cat([named[n].detach().float().flatten() for n in norm_names])
        moved = [n for n in named if n not in norm_names and not torch.equal(named[n], before[n])]
        assert moved, "the update itself is not zero: the linear weights (|w| << 1) move"
        if not master:
            assert type(opt.chained[0]).__name__ == "FP32Optimizer"
            moments = [v for s in opt.chained[0].optimizer.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.dim() > 0]
            assert {v.dtype for v in moments} == {torch.bfloat16}  # torch's AdamW: moments like the params
        else:
            main = torch.cat([named[n].main_param.flatten() for n in norm_names])
            torch.testing.assert_close(main, torch.full_like(main, 1 - 3e-3), atol=1e-6, rtol=0)
    assert bool((norms[False] == 1.0).all())  # three updates of -1e-3 each lost at the bf16 grid
    assert bool((norms[True] == 0.99609375).all())


def test_bf16_without_master_weights_clips_the_gradient(tiny_dense, megatron_single):
    """SGD at lr = 1 without momentum: the update is the clipped gradient, of norm clip_grad = 1."""
    st = _stepper(tiny_dense, *BF16, "policy.precision.master_weights=false", "policy.megatron_cfg.optimizer.lr=1",
                  "policy.megatron_cfg.optimizer.optimizer=sgd", "policy.megatron_cfg.optimizer.sgd_momentum=0",
                  params_dtype=torch.bfloat16)
    before = [p.detach().float().clone() for p in st.optimizer.params]
    norm = _fill_and_step(st.optimizer, 0.1, 1)["train/grad_norm"].item()
    update = torch.cat([(b - p.detach().float()).flatten() for b, p in zip(before, st.optimizer.params)])
    assert norm > 10 and update.norm().item() == pytest.approx(1.0, rel=0.05)


def test_lr_schedule_linear_warmup_then_cosine(tiny_dense, megatron_single):
    """SGD without momentum and a gradient of ones: each update moves every weight by exactly its lr.
    Megatron's order: update k (1-based) uses lr(k - 1), then the scheduler steps; ``train/lr`` of
    ``Optimizer.step()`` is the rate the update used."""
    base, peak, warmup, decay = 1e-3, 1e-2, 2, 6

    def lr(n):
        if n <= warmup:
            return base + (peak - base) * n / warmup
        if n > decay:
            return base
        return base + (peak - base) * 0.5 * (math.cos(math.pi * (n - warmup) / (decay - warmup)) + 1)

    st = _stepper(tiny_dense, "policy.megatron_cfg.optimizer.optimizer=sgd",
                  "policy.megatron_cfg.optimizer.sgd_momentum=0", f"policy.megatron_cfg.optimizer.lr={peak}",
                  f"policy.megatron_cfg.optimizer.min_lr={base}",
                  "policy.megatron_cfg.optimizer.clip_grad=0", "policy.megatron_cfg.scheduler.lr_decay_style=cosine",
                  f"policy.megatron_cfg.scheduler.lr_warmup_iters={warmup}",
                  f"policy.megatron_cfg.scheduler.lr_warmup_init={base}",
                  f"policy.megatron_cfg.scheduler.lr_decay_iters={decay}")
    opt = st.optimizer
    for k in range(1, decay + 3):
        before = torch.cat([p.detach().flatten() for p in opt.params])
        reported = _fill_and_step(opt, 1.0, 1)["train/lr"].item()
        applied = (before - torch.cat([p.detach().flatten() for p in opt.params])).double().mean().item()
        assert applied == pytest.approx(lr(k - 1), rel=1e-4), k
        assert reported == pytest.approx(lr(k - 1), rel=1e-6), k
    assert lr(1) == pytest.approx((base + peak) / 2) and lr(4) == pytest.approx((base + peak) / 2)


@pytest.mark.parametrize("overrides, match", [
    (["policy.optimizer.lr=1e-5"], r"'policy.optimizer'.*moved to policy\.megatron_cfg\.optimizer"),
    (["cluster.assume_distributed_optimizer=true"],
     r"moved to policy\.megatron_cfg\.optimizer\.use_distributed_optimizer"),
    (["policy.precision.master_weights=false"],
     r"policy\.precision\.master_weights=false needs params_dtype bfloat16 or float16"),
    (["policy.precision.master_weights=false", *BF16, "policy.megatron_cfg.optimizer.use_distributed_optimizer=true"],
     r"master_weights=false cannot be combined with policy\.megatron_cfg\.optimizer\.use_distributed_optimizer"),
], ids=["old-optimizer-key", "old-cluster-key", "no-master-fp32", "no-master-distributed"])
def test_config_errors_name_the_key(overrides, match):
    from megatron_grpo.config.recipe import load_recipe

    with pytest.raises(ValueError, match=match):
        load_recipe(RECIPE, overrides)
