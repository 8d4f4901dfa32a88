"""FP8 training (``policy.megatron_cfg.fp8`` / ``fp8_recipe``): Transformer Engine's FP8 GEMMs, selected on GPU
only; here the keys, the refusal off GPU / without TE, the dry run, and the TransformerConfig they build."""

import os

import pytest
import torch

from megatron_grpo.config.recipe import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "recipes", "grpo-qwen3-30b-a3b-2x8gpu.yaml")
FP8_TRAINING = ["policy.megatron_cfg.fp8=hybrid", "policy.megatron_cfg.fp8_recipe=tensorwise"]


def test_fp8_training_keys_are_checked_and_refused_off_gpu(capsys, monkeypatch):
    from megatron_grpo.trainer import launch
    from megatron_grpo.trainer.layout import check_machine

    monkeypatch.chdir(ROOT)
    cfg = load_recipe(CLUSTER, FP8_TRAINING)
    assert cfg.policy.megatron_cfg.fp8_training == ("hybrid", "tensorwise")
    assert load_recipe(CLUSTER).policy.megatron_cfg.fp8_training is None  # off by default; recipe blockwise
    for overrides, message in (
            (["policy.megatron_cfg.fp8=e5m2"], r"policy.megatron_cfg.fp8 must be null, e4m3 or hybrid, got 'e5m2'"),
            (["policy.megatron_cfg.fp8_recipe=mxfp8"], r"policy.megatron_cfg.fp8_recipe must be one of blockwise"),
            (FP8_TRAINING + ["policy.megatron_cfg.transformer_impl=local"],
             r"policy.megatron_cfg.fp8=hybrid runs Transformer Engine's FP8 GEMMs: set policy.megatron_cfg.transformer_"
             r"impl=te \(got local\)"),
            (FP8_TRAINING + ["policy.precision.shadow_dtype=float32"],
             r"policy.megatron_cfg.fp8=hybrid with policy.precision.shadow_dtype=float32 != compute_dtype=bfloat16")):
        with pytest.raises(ValueError, match=message):
            load_recipe(CLUSTER, overrides)
    for cuda, te in ((False, False), (True, False)):
        with pytest.raises(ValueError, match=r"policy.megatron_cfg.fp8=hybrid: FP8 training runs Transformer Engine's "
                                             r"FP8 GEMMs, which need CUDA and Transformer Engine"):
            check_machine(cfg, cuda=cuda, capability=(9, 0), te=te)
    check_machine(cfg, cuda=True, capability=(9, 0), te=True)
    # the dry run validates the keys for the cluster the recipe describes; a run here refuses them by name
    assert launch.main(CLUSTER, FP8_TRAINING, dry_run=True, world_size=16) == 0
    assert launch.main(CLUSTER, ["policy.megatron_cfg.fp8=e5m2"], dry_run=True, world_size=16) == 2
    if not torch.cuda.is_available():
        capsys.readouterr()
        assert launch.main(CLUSTER, FP8_TRAINING, world_size=16) == 2
        assert "error: policy.megatron_cfg.fp8=hybrid: FP8 training runs" in capsys.readouterr().out


@pytest.mark.parametrize("fp8, recipe", [("e4m3", "blockwise"), ("hybrid", "delayed"), ("e4m3", "tensorwise")])
def test_fp8_training_sets_megatrons_transformer_config(fp8, recipe):
    """The TransformerConfig the run builds carries Megatron-Core's FP8 fields (0.16.1 and 0.19.x: the same
    names), which its transformer block turns into TE's fp8_autocast; without them FP8 stays off."""
    from megatron.core.enums import Fp8Recipe

    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf, transformer_config

    shape = shape_from_hf(load_hf_config(os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b")))
    config = transformer_config(shape, params_dtype=torch.bfloat16, fp8_training=(fp8, recipe))
    assert config.fp8 == fp8 and config.fp8_recipe == recipe == Fp8Recipe(recipe) and config.bf16
    off = transformer_config(shape, params_dtype=torch.bfloat16)
    assert off.fp8 is None and off.fp8_param is False
