"""FP8 rollouts on vLLM: the machine check, the pushed FP8 weights under HF names, vLLM's FP8 parameters."""

import os

import pytest

from megatron_grpo.config.schema import Config, from_dict

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
    if not __import__("torch").cuda.is_available():
        assert launch.main(TINY_RECIPE, overrides) == 2
        assert "error: policy.precision.generation_dtype=fp8 with generation.backend=vllm" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"'generation.vllm_cfg' .* moved to policy.precision.generation_dtype"):
        from_dict(Config, {"generation": {"vllm_cfg": {"precision": "fp8"}}})
