"""The FP8 kernel residual (models/fp8_kernels.py, the GPU check's fp8 phase): a real block-scaled FP8 GEMM
(torch._scaled_mm per K slice) against an fp64 reference and against our emulation; the phase's contract."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "cluster"))


def test_real_fp8_gemm_is_the_block_scaled_product_and_rounds_like_the_emulation():
    """``real_fp8_gemm`` = sum over K blocks of (q_x q_w) x s_x x s_w, computed here in fp64 from the bytes;
    rounded to bf16 it equals the emulated FP8 GEMM (``models.fp8``'s definition) but for fp32 rounding."""
    from megatron_grpo.models.fp8 import Fp8Recipe, quantize_activation, quantize_weight
    from megatron_grpo.models.fp8_kernels import emulated_fp8_gemm, real_fp8_gemm, real_fp8_linear

    gen = torch.Generator().manual_seed(0)
    recipe = Fp8Recipe((32, 32), 32)
    x = torch.randn(2, 13, 96, generator=gen) * torch.logspace(-2, 1, 96)  # uneven columns: scales that differ
    w = torch.randn(64, 96, generator=gen) * 0.05
    q, scale = quantize_weight(w, recipe.weight_block_size)
    xq, x_scale = quantize_activation(x.reshape(-1, 96), 32)
    reference = torch.zeros(26, 64, dtype=torch.float64)
    for j in range(3):
        cols = slice(32 * j, 32 * (j + 1))
        reference += (xq[:, cols].double() @ q[:, cols].double().t()) * x_scale[:, j:j + 1].double() \
            * scale[:, j].double().repeat_interleave(32)[None, :]
    real = real_fp8_gemm(xq, x_scale, q, scale, (32, 32))
    assert real.dtype == torch.float32 and real.shape == (26, 64)
    assert ((real.double() - reference).abs() <= 1e-6 * reference.abs().max()).all()
    emulated = emulated_fp8_gemm(x.reshape(-1, 96), q, scale, recipe)
    linear = real_fp8_linear(x, q, scale, recipe)
    assert linear.shape == (2, 13, 64) and linear.dtype == emulated.dtype == torch.bfloat16
    equal = (linear.reshape(-1, 64).view(torch.int16) == emulated.view(torch.int16)).float().mean().item()
    assert equal > 0.95
    assert (linear.reshape(-1, 64).float() - emulated.float()).abs().max() <= 2 ** -7 * emulated.float().abs().max()
    wrong = real_fp8_gemm(xq, x_scale, q, scale.flip(0), (32, 32))  # scales of other rows: not rounding
    assert (wrong - real).abs().max() > 2 ** -6 * real.abs().max()


@pytest.mark.parametrize("change, message", [
    (dict(gemm_rel_max=0.1), "differs from the emulation by 1.00e-01"),
    (dict(gemm_equal_fraction=0.2), "only 0.200 of bf16 outputs equal"),
    (dict(lp_residual_abs_mean=0.01), "exceeds 2.0 x the emulation's own fp32 noise"),
    (dict(lp_fp8_gap_abs_mean=0.002), "or the FP8 gap 2.00e-03"),
])
def test_fp8_phase_contract(change, message):
    from gpu_check_report import fp8_errors

    good = dict(gemm_rel_max=3e-3, gemm_equal_fraction=0.999, lp_residual_abs_mean=0.004,
                lp_fp32_noise_abs_mean=0.0035, lp_fp8_gap_abs_mean=0.007)
    assert fp8_errors(good) == []
    errors = fp8_errors(dict(good, **change))
    assert len(errors) == 1 and message in errors[0]
