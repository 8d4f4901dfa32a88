"""The text report of ``tools/cluster/gpu_check.py``'s phases (its measurements, one block per phase), and the fp8
phase's contract (``fp8_errors``)."""

from __future__ import annotations

from typing import Dict, List

from megatron_grpo.observe.phases import fmt_value

FP8_LIMITS = dict(max_rel=2.0 ** -6, min_equal=0.5, max_noise=2.0)
"""fp8 phase: the real kernel within a few bf16 steps of the emulation at every linear's largest output, half its
bf16 outputs bit-equal, its log-prob residual within twice the emulation's own fp32 noise and below the FP8 gap."""


def report_beta(beta: Dict) -> List[str]:
    f = fmt_value
    lines = [f"beta ({beta['tokens']} tokens; buckets by fp64 log-prob: common {beta['tokens_common']}, "
             f"medium {beta['tokens_medium']}, rare {beta['tokens_rare']}):"]
    for kind, names in (("beta", ("bf16", "fp16")), ("err_vs_fp64", ("fp32", "bf16", "fp16"))):
        for name in names:
            p = f"{kind}_{name}_abs_"
            label = f"fp32 - {name}" if kind == "beta" else f"{name} - fp64"
            lines.append(f"  |{label:>11}|: mean {f(beta[p + 'mean'])}  max {f(beta[p + 'max'])}  common "
                         f"{f(beta[p + 'mean_common'])}  medium {f(beta[p + 'mean_medium'])}  rare "
                         f"{f(beta[p + 'mean_rare'])}")
    lines.append("  forward s (after warm-up): " + "  ".join(f"{d} {beta[f'forward_s_{d}']:.3f}"
                                                            for d in ("fp32", "bf16", "fp16", "fp64")))
    return lines


def report_run(name: str, run: Dict) -> List[str]:
    f = fmt_value
    lines = [f"run {name} ({run['recipe']}, generation.backend=megatron): {run['steps_logged']} steps; step s "
             f"mean after the first {f(run['step_s_mean_after_first'], '.2f')}",
             "  step  |beta|mean  |beta|max  region  phantom_reg  legit_reg  zero_grad  phantom_zg  reward  "
             "len  loss_scale  step_s  gen_s  train_s"]
    for i in range(run["steps_logged"]):
        v = {k: values[i] for k, values in run.items() if isinstance(values, list) and len(values) > i}
        lines.append(f"  {i + 1:>4}  {f(v['precision/beta_abs_mean'])}  {f(v['precision/beta_abs_max'])}  "
                     f"{f(v['clip/region_fraction'], '.4f')}  {f(v['clip/phantom_region_fraction'], '.4f')}"
                     f"       {f(v['clip/legit_region_fraction'], '.4f')}     "
                     f"{f(v['clip/zero_grad_fraction'], '.4f')}     "
                     f"{f(v['clip/phantom_zero_grad_fraction'], '.4f')}      {f(v['reward/mean'], '.2f')}  "
                     f"{f(v['completion/length_mean'], '.1f')}  {f(v['train/loss_scale'], '.0f'):>10}  "
                     f"{f(v['time/step_s'], '.2f')}  {f(v['timing/generate_s'], '.2f')}  "
                     f"{f(v['timing/train_s'], '.2f')}")
    return lines


def report_fp8(fp8: Dict) -> List[str]:
    f = fmt_value
    return [f"fp8 (weight blocks {fp8['weight_block_size']}, activation groups {fp8['activation_block_size']}; "
            f"{fp8['num_fp8_linears']} linears, {fp8['tokens']} tokens): our emulated FP8 GEMM vs a real one "
            "(torch._scaled_mm per K slice)",
            f"  per linear: worst max|real - emulated| / max|emulated| {f(fp8['gemm_rel_max'])}, bf16 outputs "
            f"equal {fp8['gemm_equal_fraction']:.4f} of {fp8['gemm_outputs']}",
            f"  log-probs: |real - emulated| mean {f(fp8['lp_residual_abs_mean'])} max {f(fp8['lp_residual_abs_max'])}"
            f"; the emulation's own fp32 noise mean {f(fp8['lp_fp32_noise_abs_mean'])} max "
            f"{f(fp8['lp_fp32_noise_abs_max'])}; the FP8 gap |emulated - bf16| mean {f(fp8['lp_fp8_gap_abs_mean'])} "
            f"max {f(fp8['lp_fp8_gap_abs_max'])}",
            "  forward s: " + "  ".join(f"{k} {fp8[f'forward_s_{k}']:.3f}" for k in ("bf16", "emulated", "real"))]


def fp8_errors(result: Dict, max_rel: float = FP8_LIMITS["max_rel"], min_equal: float = FP8_LIMITS["min_equal"],
               max_noise: float = FP8_LIMITS["max_noise"]) -> List[str]:
    """The phase's contract: the real kernel differs from the emulation by rounding only (worst linear within
    ``max_rel`` of its largest output; at least ``min_equal`` of bf16 outputs bit-equal), and in log-probs by at
    most ``max_noise`` x what another fp32 path of the emulation itself moves them, and less than the FP8 gap."""
    errors = []
    if not result["gemm_rel_max"] <= max_rel:
        errors.append(f"fp8: a linear's real FP8 GEMM differs from the emulation by {result['gemm_rel_max']:.2e} of "
                      f"its largest output (> {max_rel:.1e}): not rounding")
    if not result["gemm_equal_fraction"] >= min_equal:
        errors.append(f"fp8: only {result['gemm_equal_fraction']:.3f} of bf16 outputs equal (< {min_equal})")
    residual, noise, gap = (result[f"lp_{k}_abs_mean"] for k in ("residual", "fp32_noise", "fp8_gap"))
    if not (residual <= max_noise * noise and residual < gap):
        errors.append(f"fp8: log-prob residual real vs emulated {residual:.2e} exceeds {max_noise} x the emulation's "
                      f"own fp32 noise {noise:.2e} or the FP8 gap {gap:.2e}")
    return errors
