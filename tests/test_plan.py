"""Memory plan: parameter / optimizer bytes against real tiny models, sharding by hand, the fit check, dry run."""

import json
import os

import pytest
import torch

from megatron_grpo.config import Config, OptimizerConfig, PrecisionConfig, from_dict
from megatron_grpo.models.qwen3 import ModelShape, load_hf_config, shape_from_hf
from megatron_grpo.plan import (GIB, check_fits, count_params, format_plan, layer_activation_bytes, memory_plan,
                                optimizer_bytes)
from megatron_grpo.recipe import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = [("grpo-qwen3-30b-a3b-2x8gpu.yaml", 16), ("grpo-qwen3-235b-a22b-8x8gpu.yaml", 64)]
REPLICATED_FITS = {"grpo-qwen3-30b-a3b-2x8gpu.yaml": False, "grpo-qwen3-235b-a22b-8x8gpu.yaml": True}

SHAPE = ModelShape(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
                   head_dim=16, ffn_hidden_size=128, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=512,
                   tie_word_embeddings=False, num_experts=8, moe_topk=2, moe_ffn_hidden_size=32)


def _built(model_dir, params_dtype=torch.float32):
    from megatron_grpo.models import build_from_hf

    model, shape = build_from_hf(model_dir, params_dtype=params_dtype, load_weights=False)
    return model, shape


@pytest.mark.parametrize("fixture", ["tiny_dense", "tiny_moe", "tiny_tied"])
def test_param_count_equals_the_built_model(fixture, request, megatron_single):
    model, shape = _built(request.getfixturevalue(fixture))
    count = count_params(shape)
    named = list(model.named_parameters())
    assert count.num_local == sum(p.numel() for _, p in named)
    assert count.num_expert_local == sum(p.numel() for n, p in named if ".experts." in n)


def test_tp_ep_pp_sharding_by_hand():
    h, d, v = 64, 16, 1000
    attn = 2 * h + 2 * d + h * (8 + 2 * 4) * d // 2 + 8 * d * h // 2 + 8 * h  # norms, qkv/TP, proj/TP, router
    experts = 8 // 4 * 3 * h * 32  # 2 local experts of 3 [h, 32] GEMMs
    first = count_params(SHAPE, tp=2, pp=2, ep=4, stage=0)
    last = count_params(SHAPE, tp=2, pp=2, ep=4, stage=1)
    assert (first.num_dense_local, first.num_expert_local) == (2 * attn + v * h // 2, 2 * experts)
    assert last.num_dense_local == 2 * attn + v * h // 2 + h  # output layer + final norm
    assert count_params(SHAPE, ep=2, etp=2).num_expert_local == 4 * 8 * 3 * h * 32 // 4
    half = optimizer_bytes(first, "bfloat16", dp=2, expert_dp=4)
    assert half == 12 * (first.num_dense_local / 2 + first.num_expert_local / 4)


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_replicated_optimizer_bytes_equal_the_optimizer_allocation(params_dtype, tiny_moe, megatron_single):
    from megatron_grpo.optim import Optimizer

    model, shape = _built(tiny_moe, getattr(torch, params_dtype))
    opt = Optimizer(model, OptimizerConfig(), PrecisionConfig(params_dtype=params_dtype, compute_dtype=params_dtype))
    for p in opt.params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    state = [t for st in opt.adam.state.values() for t in st.values() if torch.is_tensor(t)]
    masters = opt.master if opt.half else []
    allocated = sum(t.numel() * t.element_size() for t in state + masters)
    planned = optimizer_bytes(count_params(shape), params_dtype)
    assert abs(planned - allocated) <= 0.02 * allocated, (planned, allocated)


def test_activation_formula_by_hand():
    cfg = from_dict(Config, {"policy": {"train_micro_batch_size": 2, "precision": {"compute_dtype": "float32"},
                                        "megatron_cfg": {"tensor_model_parallel_size": 2}},
                             "generation": {"max_model_len": 100}})
    s, b, h, a = 100, 2, 64, 8
    full, layer_input = layer_activation_bytes(cfg, SHAPE)
    assert full == 2 * (s * b * h * (10 + 24 / 2) + 5 * a * s * s * b / 2)  # fp32 = twice the 16-bit bytes
    assert layer_input == 2 * 2 * s * b * h


def _cfg(**cluster):
    return from_dict(Config, {"policy": {"train_micro_batch_size": 8}, "generation": {"max_model_len": 512},
                              "cluster": cluster})


def test_error_names_the_biggest_term_and_its_keys():
    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b")))
    cfg = _cfg(gpu_memory_gib=4.0)
    cfg.generation.backend, cfg.generation.server_url = "vllm_server", "http://elsewhere:8000"  # no generator here
    plan = memory_plan(cfg, shape, 1)
    assert max(plan.counted, key=lambda t: t.bytes).name == "activations (no recompute)"  # local: s x s scores
    with pytest.raises(ValueError, match=r"biggest term is activations \(no recompute\).*train_micro_batch_size"):
        check_fits(plan, cfg, shape)
    cfg.policy.megatron_cfg.transformer_impl, cfg.generation.max_model_len = "te", 64
    with pytest.raises(ValueError, match=r"biggest term is optimizer \(replicated\).*tensor_model_parallel_size"):
        check_fits(memory_plan(cfg, shape, 1), cfg, shape)
    cfg.cluster.gpu_memory_gib = 40.0
    check_fits(memory_plan(cfg, shape, 1), cfg, shape)
    cfg.generation.server_url, cfg.generation.gpu_memory_utilization = None, 0.05  # colocated: 2 GiB of weights
    with pytest.raises(ValueError, match=r"generator's weights \(2.2 GiB.*generation.gpu_memory_utilization"):
        check_fits(memory_plan(cfg, shape, 1), cfg, shape)


def test_plan_without_budget_never_fails_and_has_every_term():
    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b")))
    cfg = _cfg()
    plan = memory_plan(cfg, shape, 1)
    check_fits(plan, cfg, shape)
    names = {t.name for t in plan.terms}
    assert {"parameters", "gradients", "optimizer (replicated)", "optimizer (distributed)", "logits + grad",
            "activations (no recompute)", "activations (full recompute)", "log-prob chunk buffers",
            "generator (colocated)"} <= names
    assert plan.term("optimizer (distributed)").bytes == plan.term("optimizer (replicated)").bytes  # DP = 1


@pytest.mark.parametrize("recipe, world", CLUSTER)
def test_cluster_recipes_fit_with_the_distributed_optimizer(recipe, world, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(os.path.join("recipes", recipe))
    shape = shape_from_hf(load_hf_config(cfg.policy.model_name))
    assert cfg.cluster.gpu_memory_gib and cfg.cluster.assume_distributed_optimizer
    plan = memory_plan(cfg, shape, world)
    check_fits(plan, cfg, shape)
    assert plan.total <= cfg.cluster.gpu_memory_gib * GIB
    cfg.cluster.assume_distributed_optimizer = False  # the current replicated AdamW (30B: does not fit)
    replicated = memory_plan(cfg, shape, world)
    assert (replicated.total <= cfg.cluster.gpu_memory_gib * GIB) == REPLICATED_FITS[recipe]


def test_dry_run_prints_the_table_and_json(capsys, monkeypatch):
    from megatron_grpo.train import main

    monkeypatch.chdir(ROOT)
    recipe, world = CLUSTER[0]
    assert main(os.path.join("recipes", recipe), [], dry_run=True, world_size=world) == 0
    table = capsys.readouterr().out
    assert "layout: world_size=16, tp=2" in table and "memory plan" in table and "optimizer (distributed)" in table
    assert main(os.path.join("recipes", recipe), [], dry_run=True, world_size=world, as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"config", "layout", "memory"} <= set(out) and out["memory"]["total_gib"] <= 79
    assert out["config"]["cluster"]["gpu_memory_gib"] == 79
    assert main(os.path.join("recipes", recipe), ["cluster.gpu_memory_gib=40"], dry_run=True, world_size=world) == 2
    assert "biggest term is activations (no recompute)" in capsys.readouterr().out


def test_format_plan_lists_terms_and_total():
    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b")))
    text = format_plan(memory_plan(_cfg(), shape, 1))
    assert "parameters" in text and "total" in text and "no check" in text


def test_a_real_run_checks_the_plan_before_building_anything(tiny_dense, capsys, monkeypatch):
    from megatron_grpo import train

    monkeypatch.setattr(train, "GRPOTrainer", lambda cfg: pytest.fail("built a trainer past the memory check"))
    recipe = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")
    assert train.main(recipe, [f"policy.model_name={tiny_dense}", "cluster.gpu_memory_gib=0.001",
                                "generation.backend=vllm_server", "generation.server_url=http://elsewhere:8000"]) == 2
    assert "exceeds cluster.gpu_memory_gib=0.001" in capsys.readouterr().out
