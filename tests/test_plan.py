"""Memory plan: parameter / gradient / optimizer bytes against Megatron's allocation in real tiny runs (replicated,
and distributed at DP=2), sharding by hand, the fit check, dry run."""

import dataclasses
import json
import math
import os

import pytest
import torch

from megatron_grpo.config.schema import Config, from_dict
from megatron_grpo.models.qwen3 import ModelShape, load_hf_config, shape_from_hf
from megatron_grpo.trainer.plan import (GIB, check_fits, count_params, format_plan, memory_plan, optimizer_bytes,
                                        optimizer_state)
from megatron_grpo.trainer.plan_activations import layer_activation_bytes, layer_score_bytes
from megatron_grpo.config.recipe import load_recipe
from tests._dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = [("grpo-qwen3-30b-a3b-2x8gpu.yaml", 16), ("grpo-qwen3-235b-a22b-8x8gpu.yaml", 64),
           ("grpo-qwen2.5-7b-instruct-1x8gpu.yaml", 8), ("grpo-mixtral-8x7b-2x8gpu.yaml", 16),
           ("grpo-moonlight-16b-a3b-2x8gpu.yaml", 16)]
REPLICATED_FITS = {"grpo-qwen3-30b-a3b-2x8gpu.yaml": False, "grpo-qwen3-235b-a22b-8x8gpu.yaml": True,
                   "grpo-qwen2.5-7b-instruct-1x8gpu.yaml": False, "grpo-mixtral-8x7b-2x8gpu.yaml": False,
                   "grpo-moonlight-16b-a3b-2x8gpu.yaml": True}

SHAPE = ModelShape(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
                   head_dim=16, ffn_hidden_size=128, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=512,
                   tie_word_embeddings=False, num_experts=8, moe_topk=2, moe_ffn_hidden_size=32)


def _built(model_dir, params_dtype=torch.float32):
    from megatron_grpo.models import build_from_hf

    model, shape = build_from_hf(model_dir, params_dtype=params_dtype, load_weights=False)
    return model, shape


@pytest.mark.parametrize("fixture", ["tiny_dense", "tiny_moe", "tiny_tied", "tiny_llama"])
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
    per_param, _ = optimizer_state(_cfg_of(**BF16))
    assert optimizer_bytes(first, per_param, dp=2, expert_dp=4) == 12 * (first.num_dense_local / 2
                                                                         + first.num_expert_local / 4)


BF16 = {"policy.precision.params_dtype": "bfloat16", "policy.precision.compute_dtype": "bfloat16"}
HALF_GRADS = {"policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32": False}
NO_MASTER = {"policy.precision.master_weights": False}
SGD = {"policy.megatron_cfg.optimizer.optimizer": "sgd"}


def _cfg_of(**flat):
    """A ``Config`` from dotted keys."""
    nested = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = nested
        for name in path:
            node = node.setdefault(name, {})
        node[last] = value
    return from_dict(Config, nested)


@pytest.mark.parametrize("flat, fused, per_param", [
    ({}, None, 8),  # fp32 params are their own main params: 2 fp32 moments
    (BF16, None, 12),  # fp32 main params + 2 fp32 moments
    ({"policy.precision.params_dtype": "float16", "policy.precision.compute_dtype": "float16"}, None, 12),
    ({**BF16, **HALF_GRADS}, None, 16),  # + the optimizer's fp32 copy of the bf16 gradient
    ({**BF16, **NO_MASTER}, False, 4),  # torch's AdamW: moments like the params
    ({**BF16, **NO_MASTER}, True, 8),  # TE's / Apex's FusedAdam: fp32 moments
    ({**BF16, **SGD}, None, 8),  # fp32 main params + one fp32 momentum buffer
    ({**SGD, "policy.megatron_cfg.optimizer.sgd_momentum": 0.0}, None, 0),
], ids=["fp32", "bf16", "fp16", "bf16-grads", "bf16-no-master-torch", "bf16-no-master-fused", "sgd", "sgd-no-momentum"])
def test_optimizer_state_per_parameter_by_hand(flat, fused, per_param):
    assert optimizer_state(_cfg_of(**flat), fused)[0] == per_param


ALLOCATION_CASES = {"fp32": {}, "bf16": BF16, "bf16-grads": {**BF16, **HALF_GRADS}, "bf16-no-master": {**BF16, **NO_MASTER}}


def _allocated_vs_planned(model_dir, world_size, **flat):
    """One optimizer step of a real tiny run (grads filled by hand; clip off: it does not allocate) ->
    {term: (bytes this rank allocated, bytes the plan says)} for parameters, gradients and the
    optimizer column the run uses. Gradients: DDP's buffers; parameters: DDP's param buffers when
    the distributed optimizer remaps the params there; optimizer: ``Optimizer.state_bytes()`` plus
    any main-param gradient that is not a view of DDP's buffer (the fp32 copy of half grads)."""
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.trainer.optim import Optimizer, wrap_model

    flat = {"policy.model_name": model_dir, "policy.megatron_cfg.optimizer.clip_grad": 0.0, **flat}
    cfg = _cfg_of(**flat)
    model, shape = build_from_hf(model_dir, params_dtype=getattr(torch, cfg.policy.precision.params_dtype),
                                 load_weights=False)
    model = wrap_model(model, cfg)
    opt = Optimizer(model, cfg)
    buffers = model.buffers + model.expert_parallel_buffers
    for b in buffers:
        b.grad_data.fill_(1e-3)
    assert opt.step()["train/skipped_nonfinite"].item() == 0
    grad_storage = {b.grad_data.untyped_storage().data_ptr() for b in buffers}
    main_params = [p for o in opt.chained for g in o.optimizer.param_groups for p in g["params"]]
    grad_copies = sum(p.grad.numel() * p.grad.element_size() for p in main_params
                      if p.grad is not None and p.grad.untyped_storage().data_ptr() not in grad_storage)
    if all(b.param_data is not None for b in buffers):
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    else:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = memory_plan(cfg, shape, world_size)
    column = "optimizer (distributed)" if cfg.policy.megatron_cfg.optimizer.use_distributed_optimizer \
        else "optimizer (replicated)"
    return {"parameters": (params, plan.term("parameters").bytes),
            "gradients": (sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
                          plan.term("gradients").bytes),
            "optimizer": (opt.state_bytes() + grad_copies, plan.term(column).bytes)}


def _assert_within_2_percent(terms):
    for name, (allocated, planned) in terms.items():
        assert allocated > 0 and abs(planned - allocated) <= 0.02 * allocated, (name, planned, allocated)


@pytest.mark.parametrize("case", list(ALLOCATION_CASES))
def test_plan_equals_the_replicated_optimizers_allocation(case, tiny_moe, megatron_single):
    _assert_within_2_percent(_allocated_vs_planned(tiny_moe, 1, **ALLOCATION_CASES[case]))


DISTRIBUTED_CASES = [
    # bf16 params: fp32 main params + moments, dense and experts both sharded over DP = expert-DP = 2
    (1, BF16),
    # fp32 params, EP=2: dense sharded over DP=2, each rank's experts over expert-DP=1 (not sharded)
    (2, {"policy.megatron_cfg.expert_model_parallel_size": 2}),
]


def _distributed_worker(model_dir):
    from megatron_grpo.parallel import state

    out = []
    for ep, flat in DISTRIBUTED_CASES:
        state.initialize_model_parallel(state.Layout(world_size=2, ep=ep))
        flat = {"policy.megatron_cfg.optimizer.use_distributed_optimizer": True, **flat}
        out.append(_allocated_vs_planned(model_dir, 2, **flat))
    return out


def test_plan_equals_the_distributed_optimizers_allocation_at_dp2(tiny_moe):
    ranks = run_distributed(_distributed_worker, 2, tiny_moe)
    for rank in ranks:
        for terms in rank:
            _assert_within_2_percent(terms)
    (bf16, ep2), _ = ranks
    # sharded state: bf16 = 12 B/param over 2 ranks; EP=2 fp32: 8 B/param, dense over DP=2, each rank's half of
    # the experts over expert-DP=1
    count = count_params(shape_from_hf(load_hf_config(tiny_moe)))
    assert bf16["optimizer"][1] == 12 * count.num_local / 2
    assert ep2["optimizer"][1] == 8 * (count.num_dense_local / 2 + count.num_expert_local / 2)
    # DDP's padding (param starts at 64 elements, bucket ends at lcm(DP, 128)) is the whole gap
    assert 0 < bf16["gradients"][0] - bf16["gradients"][1] <= 0.001 * bf16["gradients"][1]


def test_activation_formula_by_hand():
    cfg = from_dict(Config, {"policy": {"train_micro_batch_size": 2, "precision": {"compute_dtype": "float32"},
                                        "megatron_cfg": {"tensor_model_parallel_size": 2}},
                             "generation": {"max_model_len": 100}})
    s, b, h, a = 100, 2, 64, 8
    full, layer_input = layer_activation_bytes(cfg, SHAPE)  # MoE at TP = 2: sequence parallel, all 34 split
    assert full == 2 * (s * b * h * 34 / 2)  # fp32 = twice the 16-bit bytes
    assert layer_score_bytes(cfg, SHAPE) == 2 * 5 * a * s * s * b / 2
    assert layer_input == 2 * 2 * s * b * h / 2
    cfg.policy.megatron_cfg.sequence_parallel = False  # a dense model may run TP without SP: 10 replicated
    full, layer_input = layer_activation_bytes(cfg, dataclasses.replace(SHAPE, num_experts=0))
    assert full == 2 * (s * b * h * (10 + 24 / 2))
    assert layer_input == 2 * 2 * s * b * h
    cfg.policy.megatron_cfg.transformer_impl = "te"  # flash / fused attention keeps no scores
    assert layer_score_bytes(cfg, SHAPE) == 0


def test_interleaved_stages_hold_megatrons_in_flight_chunks():
    """Interleaved virtual stages (PP = 4, V = 2, many micro-batches): stage k holds Megatron's warmup of
    2 (PP - k - 1) + (V - 1) PP chunk forwards plus one, each chunk half the stage's layers: stage 0
    PP (1 + (PP - 1) / (PP V)) = 5.5 micro-batches' whole-stage activations (Narayanan et al. 2021), the last
    stage 2.5, 1F1B's 4 and 1; a stage's layers are its chunks' (stage 0 of 8 layers: 0 and 4)."""
    from megatron_grpo.trainer.plan_activations import num_micro_batches_in_flight, stage_layer_ids

    cfg = from_dict(Config, {"policy": {"train_micro_batch_size": 1,
                                        "megatron_cfg": {"pipeline_model_parallel_size": 4}},
                             "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8}})
    assert [num_micro_batches_in_flight(cfg, 1, k) for k in range(4)] == [4, 3, 2, 1]
    cfg.policy.megatron_cfg.virtual_pipeline_model_parallel_size = 2  # past the recipe's refusal: the plan alone
    assert [num_micro_batches_in_flight(cfg, 1, k) for k in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert 4 * (1 + 3 / 8) == 5.5
    shape = dataclasses.replace(SHAPE, num_layers=8)
    assert [stage_layer_ids(cfg, shape, k) for k in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    cfg.policy.train_micro_batch_size = 32  # 2 micro-batches: all of them in flight, 2 x V chunks = 2 stages' worth
    assert num_micro_batches_in_flight(cfg, 1, 0) == 2


def _cfg(**cluster):
    return from_dict(Config, {"policy": {"train_micro_batch_size": 8}, "generation": {"max_model_len": 512},
                              "cluster": cluster})


def test_error_names_the_biggest_term_and_its_keys():
    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b")))
    cfg = _cfg(gpu_memory_gib=4.0)
    cfg.generation.backend, cfg.generation.server_url = "vllm_server", "http://elsewhere:8000"  # no generator here
    plan = memory_plan(cfg, shape, 1)
    assert max(plan.counted, key=lambda t: t.bytes).name == "attention scores (local)"  # local: s x s scores
    with pytest.raises(ValueError, match=r"biggest term is attention scores \(local\).*train_micro_batch_size.*"
                                         r"transformer_impl"):
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
    assert cfg.cluster.gpu_memory_gib and cfg.policy.megatron_cfg.optimizer.use_distributed_optimizer
    plan = memory_plan(cfg, shape, world)
    assert plan.distributed_optimizer and "distributed optimizer" in format_plan(plan)
    check_fits(plan, cfg, shape)
    assert plan.total <= cfg.cluster.gpu_memory_gib * GIB
    cfg.policy.megatron_cfg.optimizer.use_distributed_optimizer = False  # replicated optimizer state (30B: no fit)
    replicated = memory_plan(cfg, shape, world)
    assert (replicated.total <= cfg.cluster.gpu_memory_gib * GIB) == REPLICATED_FITS[recipe]


def test_dry_run_prints_the_table_and_json(capsys, monkeypatch):
    from megatron_grpo.trainer.launch import main

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
    assert "biggest term is parameters" in capsys.readouterr().out  # SP (TP=2) split the activations


def test_format_plan_lists_terms_and_total():
    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b")))
    text = format_plan(memory_plan(_cfg(), shape, 1))
    assert "parameters" in text and "total" in text and "no check" in text


def test_a_real_run_checks_the_plan_before_building_anything(tiny_dense, capsys, monkeypatch):
    from megatron_grpo.trainer import launch, loop

    monkeypatch.setattr(loop, "GRPOTrainer", lambda cfg: pytest.fail("built a trainer past the memory check"))
    recipe = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")
    assert launch.main(recipe, [f"policy.model_name={tiny_dense}", "cluster.gpu_memory_gib=0.001",
                                "generation.backend=vllm_server", "generation.server_url=http://elsewhere:8000"]) == 2
    assert "exceeds cluster.gpu_memory_gib=0.001" in capsys.readouterr().out


def test_push_reference_routes_and_moe_terms_by_hand():
    """The weight push's buffers (stage leaders), a reference model, MoE dispatch activations and the routing
    records (R3 adds the generator's routes) are counted; the megatron backend pushes nothing."""
    from megatron_grpo.trainer.plan import largest_hf_tensor

    cfg = from_dict(Config, {"policy": {"train_micro_batch_size": 2, "precision": {"compute_dtype": "bfloat16",
                                                                                 "generation_dtype": "bfloat16"},
                                        "megatron_cfg": {"moe_routing_replay": "R3"}},
                             "generation": {"max_model_len": 100, "weight_push_bucket_mb": 1.0},
                             "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
                             "loss_fn": {"reference_policy_kl_penalty": 0.1}})
    shape = dataclasses.replace(SHAPE, moe_topk=8, moe_ffn_hidden_size=128)
    plan = memory_plan(cfg, shape, 1)
    assert largest_hf_tensor(shape) == 1000 * 64  # the embedding
    layer = (2 * 8 + 2 * 4) * 16 * 64 + 2 * 64 + 2 * 16 + 8 * (3 * 128 * 64 + 64)  # attention + norms + experts
    assert plan.term("weight push buffers").bytes == 4 * (2 ** 20 + layer * 2) + 2 * 1000 * 64 * 2  # > the embedding
    assert plan.term("reference model").bytes == plan.term("parameters").bytes
    assert plan.term("routing records").bytes == 4 * 8 * 100 * 4 * 8 * 2  # 4 records x rows x s x layers x k x 2 B
    tokens, h, f = 200, 64, 128
    per_layer = tokens * (8 * (h + 3 * f) * 2 + 2 * 8 * 4) - tokens * h * (3 + 16)  # minus the dense MLP
    assert plan.term("MoE dispatch activations").bytes == pytest.approx(per_layer * 4)  # 4 layers, 1 in flight
    cfg.generation.backend, cfg.loss_fn.reference_policy_kl_penalty = "megatron", 0.0
    names = {t.name for t in memory_plan(cfg, shape, 1).terms}
    assert "weight push buffers" not in names and "reference model" not in names


def test_push_buffers_hold_whole_layers_as_the_exported_checkpoint_has_them(tiny_dense, tiny_moe):
    """A bucket closes only between layers, so the plan's layer size must be a real layer's: checked on the
    HF files of both tiny models; at Qwen3-30B-A3B's shape one layer's experts alone are over 1 GiB in bf16,
    which the push buffers of the cluster recipe now carry."""
    from safetensors import safe_open

    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.trainer.plan import layer_hf_elements

    for model_dir in (tiny_dense, tiny_moe):
        with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
            layer0 = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("model.layers.0."))
        assert layer_hf_elements(shape_from_hf(load_hf_config(model_dir))) == layer0, model_dir
    a3b = dataclasses.replace(SHAPE, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                              num_experts=128, moe_topk=8, moe_ffn_hidden_size=768, vocab_size=151936)
    cfg = from_dict(Config, {"policy": {"precision": {"generation_dtype": "bfloat16"}}})
    assert layer_hf_elements(a3b) * 2 > 2 ** 30
    assert memory_plan(cfg, a3b, 1).term("weight push buffers").bytes > 4 * 2 ** 30



@pytest.mark.vllm
def test_nccl_transport_adds_vllms_packed_buffers_on_rank_0_only():
    """vLLM's nccl weight transfer packs the push into 2 x 1 GiB buffers (each closed once past 1 GiB, so up to
    one tensor more) on trainer rank 0, the only member of its group with the engines: stage 0 counts them, the
    last pipeline stage and the gloo transport do not. Every rank has the stated runtime headroom."""
    from megatron_grpo.trainer import plan as planning

    cfg = from_dict(Config, {"policy": {"megatron_cfg": {"pipeline_model_parallel_size": 2}},
                             "generation": {"backend": "vllm_server", "server_url": "http://elsewhere:8000"}})
    first, last = (planning._stage_plan(cfg, SHAPE, 2, stage) for stage in (0, 1))
    assert "vLLM nccl packed buffers" in {t.name for t in first.terms}  # auto = nccl for a dedicated server on GPU
    assert "vLLM nccl packed buffers" not in {t.name for t in last.terms}
    largest = planning.largest_hf_tensor(SHAPE) * 4  # fp32 generation
    assert first.term("vLLM nccl packed buffers").bytes == 2 * (GIB + largest)
    from vllm.distributed.weight_transfer import packed_tensor

    assert (planning.VLLM_PACKED_BUFFER_BYTES, planning.VLLM_PACKED_NUM_BUFFERS) == (
        packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES, packed_tensor.DEFAULT_PACKED_NUM_BUFFERS)
    for stage in (first, last):
        assert stage.term("runtime headroom").bytes == planning.RUNTIME_HEADROOM_BYTES
        assert "runtime headroom" in format_plan(stage)
    cfg.generation.weight_transfer = "gloo"
    assert "vLLM nccl packed buffers" not in {t.name for t in planning._stage_plan(cfg, SHAPE, 2, 0).terms}


QWEN3_06B = os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b")
PACKED_8K = {"sequence_packing": {"enabled": True, "train_mb_tokens": 8192}}
BUDGET_64K = {"dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": 65536}}


def _batching_cfg(batching=None, impl="local", budget=None):
    """Qwen3-0.6B in bf16, 8 rows of max_model_len 1024 per padded micro-batch, no generator on this device."""
    return from_dict(Config, {"policy": {"train_micro_batch_size": 8, **(batching or {}),
                                         "precision": {"params_dtype": "bfloat16", "compute_dtype": "bfloat16"},
                                         "megatron_cfg": {"transformer_impl": impl}},
                              "generation": {"max_model_len": 1024, "backend": "vllm_server",
                                             "server_url": "http://elsewhere:8000", "weight_transfer": "gloo"},
                              "cluster": {"gpu_memory_gib": budget}})


def test_token_budget_and_packed_rows_size_every_token_term_by_hand():
    """Activations, the local spec's attention scores and the logits follow the micro-batch the step really
    computes: 8 padded rows of 1024 (8192 tokens), a 64k token budget (64 rows of 1024 at most), a packed row of
    8192 (8 x 1k packed into 8k: 64M scores per head vs 8M padded, said in the note), a packed row of the
    longest sequence (train_mb_tokens 0) and a budget below one sequence (that sequence alone)."""
    shape = shape_from_hf(load_hf_config(QWEN3_06B))
    h, a, layers, v = 1024, 16, 28, 151936  # bf16: Korthikanti's 16-bit bytes as they are
    cases = {"padded": ({}, 8192, 8 * 1024 ** 2), "budget": (BUDGET_64K, 65536, 64 * 1024 ** 2),
             "packed": (PACKED_8K, 8192, 8192 ** 2),
             "packed-longest": ({"sequence_packing": {"enabled": True}}, 1024, 1024 ** 2),
             "small-budget": ({"dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": 512}}, 1024,
                              1024 ** 2)}
    for name, (batching, tokens, scores) in cases.items():
        plan = memory_plan(_batching_cfg(batching), shape, 1)
        assert plan.term("activations (no recompute)").bytes == tokens * h * 34 * layers, name
        assert plan.term("attention scores (local)").bytes == 5 * a * scores * layers, name
        assert plan.term("logits + grad").bytes == 2 * tokens * v * 2, name
    note = memory_plan(_batching_cfg(PACKED_8K), shape, 1).term("attention scores (local)").note
    assert "67.11M scores per head vs 8.389M" in note and "packing costs 8x padding" in note
    assert "no more than padding" in memory_plan(_batching_cfg(cases["packed-longest"][0]), shape, 1).term(
        "attention scores (local)").note
    assert "attention scores (local)" not in {t.name for t in memory_plan(_batching_cfg(PACKED_8K, "te"), shape, 1).terms}


def test_packed_rows_round_like_the_step_and_moe_dispatch_follows_the_tokens():
    from megatron_grpo.trainer.plan_activations import micro_batch

    cfg = from_dict(Config, {"policy": {"sequence_packing": {"enabled": True, "train_mb_tokens": 8200},
                                        "megatron_cfg": {"tensor_model_parallel_size": 2}},
                             "generation": {"max_model_len": 100}})
    assert micro_batch(cfg, SHAPE).num_tokens == 8208  # rows a multiple of 8 x TP under sequence parallelism
    padded = from_dict(Config, {"policy": {"train_micro_batch_size": 2}, "generation": {"max_model_len": 100}})
    budget = from_dict(Config, {"policy": {"dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": 1600}},
                                "generation": {"max_model_len": 100}})
    dispatch = [memory_plan(c, SHAPE, 1).term("MoE dispatch activations").bytes for c in (padded, budget)]
    assert dispatch[1] == pytest.approx(8 * dispatch[0])  # 1600 tokens vs 2 x 100: linear in the tokens


def test_a_token_budget_or_packed_row_that_runs_out_of_memory_fails_check_fits():
    """Padded, the recipe fits; the same recipe with a 64k token budget (TE) or with 8k packed rows (local spec:
    the row's 8k^2 scores) does not, and the error names the term and the key. The old plan sized every
    micro-batch as train_micro_batch_size x max_model_len and let both through."""
    shape = shape_from_hf(load_hf_config(QWEN3_06B))
    for impl, budget in (("te", 40.0), ("local", 60.0)):
        cfg = _batching_cfg(impl=impl, budget=budget)
        check_fits(memory_plan(cfg, shape, 1), cfg, shape)
    cfg = _batching_cfg(BUDGET_64K, "te", 40.0)
    with pytest.raises(ValueError, match=r"biggest term is activations \(no recompute\).*max_tokens_per_microbatch"):
        check_fits(memory_plan(cfg, shape, 1), cfg, shape)
    cfg = _batching_cfg(PACKED_8K, "local", 60.0)
    with pytest.raises(ValueError, match=r"biggest term is attention scores \(local\).*train_mb_tokens.*transformer_impl"):
        check_fits(memory_plan(cfg, shape, 1), cfg, shape)
    cfg = _batching_cfg(PACKED_8K, "te", 40.0)  # the same tokens as 8 padded rows: no scores kept
    check_fits(memory_plan(cfg, shape, 1), cfg, shape)


def test_delta_push_copy_is_counted_on_rank_0_by_hand():
    """``generation.delta_push`` keeps rank 0's shards as last sent in the generation dtype (+ whole copies of the
    gathered tensors of at most 1M elements, + the uint8 masks of the largest tensor being gathered); at PP > 1 each
    stage's leader keeps its own stage's (it pushes its own layers); none without it. Measured against a real TP = 2 x EP = 2 push in tests/test_delta.py."""
    from megatron_grpo.trainer.plan import gathered_checksummed_elements, largest_hf_tensor

    shape = shape_from_hf(load_hf_config(QWEN3_06B))

    def plan(**flat):
        return memory_plan(_cfg_of(**{"policy.precision.generation_dtype": "bfloat16", "generation.delta_push": True,
                                      **flat}), shape, 2)

    largest = 151936 * 1024  # the (tied) embedding
    assert plan().term("delta push copy").bytes == 2 * count_params(shape).num_local + 2 * largest
    tp2 = {"policy.megatron_cfg.tensor_model_parallel_size": 2}
    kv = 8 * 128 * 1024  # k_proj / v_proj: 1M elements each, the only TP-split tensors of 0.6B at most 1M
    assert gathered_checksummed_elements(shape, tp=2) == 28 * 2 * kv
    assert plan(**tp2).term("delta push copy").bytes == 2 * (count_params(shape, tp=2).num_local + 28 * 2 * kv) \
        + 2 * largest
    assert largest_hf_tensor(shape) == largest
    pp2 = plan(**{"policy.megatron_cfg.pipeline_model_parallel_size": 2})  # each stage's leader keeps its own
    stage = count_params(shape, pp=2, stage=pp2.stage)
    assert pp2.term("delta push copy").bytes == 2 * stage.num_local + 2 * largest
    assert 0 < stage.num_local < count_params(shape).num_local
    assert gathered_checksummed_elements(shape, tp=2, num_layers=14) == 14 * 2 * kv  # a stage's layers
    assert "delta push copy" not in {t.name for t in plan(**{"generation.delta_push": False}).terms}
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "mixtral", "deepseek-v3"])
def test_family_param_counts_and_layer_sizes_equal_the_built_model(arch, tiny_family, megatron_single):
    """Qwen2's q/k/v biases, Mixtral's experts, DeepSeek-V3's multi-latent attention, shared experts and
    dense first layer: the plan's parameter count is the built model's (at TP=1 and, by hand, TP=2), its
    largest layer and tensor are those of the HF checkpoint, and the generator's KV cache per token is
    MLA's latent (kv_lora_rank + qk_rope_head_dim = 576 per layer), not 2 x heads x head_dim."""
    from safetensors import safe_open

    from megatron_grpo.trainer.plan import largest_hf_tensor, layer_hf_elements

    model_dir = tiny_family(arch)
    model, shape = _built(model_dir)
    named = list(model.named_parameters())
    count = count_params(shape)
    assert count.num_local == sum(p.numel() for _, p in named)
    assert count.num_expert_local == sum(p.numel() for n, p in named if ".experts." in n)
    replicated = sum(p.numel() for n, p in named if "norm" in n or "router" in n or n.endswith("bias") and "qkv" not in n)
    assert count_params(shape, tp=2).num_dense_local == (count.num_dense_local - replicated) // 2 + replicated
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}
    layers = [sum(v for k, v in sizes.items() if k.startswith(f"model.layers.{i}.")) for i in range(shape.num_layers)]
    assert layer_hf_elements(shape) == max(layers)
    assert largest_hf_tensor(shape) == max(sizes.values())
    per_layer = 576 if arch == "deepseek-v3" else 2 * shape.num_kv_heads * shape.head_dim
    assert shape.kv_cache_elements_per_token() == shape.num_layers * per_layer
