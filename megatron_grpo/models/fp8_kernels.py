"""The FP8 kernel residual: our emulated FP8 GEMM (``models.fp8``: both operands dequantized, one fp32 matmul,
output rounded to bf16) against a real FP8 GEMM on the same bytes (``torch._scaled_mm``: e4m3 x e4m3 products
accumulated in fp32 by the hardware), per linear and through the model's log-probs (``tools/cluster/gpu_check.py``'s
``fp8`` phase; the GPU it runs on has neither vLLM nor TE, so this is the closest thing to "vLLM's FP8 vs our
FP8 shadow": the part of their gap that is the kernels, not the quantization).

The real GEMM is block-scaled the way DeepGEMM and CUTLASS's block-FP8 kernels are: for each ``bk``-wide slice
of the input dimension one FP8 GEMM with unit scales (``_scaled_mm`` with per-tensor scales: every FP8 GPU
and torch 2.13's CPU build have it), its fp32 result multiplied by the slice's activation scale (per token)
and weight scale (per ``bn`` output rows), the slices summed in fp32, the sum rounded to bf16. The two differ
by fp32 rounding only (where the scales are applied, summation order), so after the bf16 rounding most outputs
are equal and the rest one bf16 step apart. Imports megatron.core (through ``models``): for the process that
measures.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Tuple

import torch

from megatron_grpo.models import build_from_hf, forward_logits, unwrap
from megatron_grpo.models.fp8 import (OUTPUT_DTYPE, Fp8Recipe, dequantize_weight, fake_quantize_activation,
                                      fp8_forward, fp8_linears, quantize_activation, quantize_weight)
from megatron_grpo.models.forward import model_device, precision_context
from megatron_grpo.models.spec import configure_fp32_matmul
from megatron_grpo.parallel import state

PAD_ROWS = 16
"""cuBLASLt's FP8 GEMMs want every dimension a multiple of 16: token rows are padded with zeros."""


def real_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                  block: Tuple[int, int]) -> torch.Tensor:
    """fp32 ``[M, N]`` of a block-scaled FP8 GEMM: ``xq`` ``[M, K]`` e4m3 with ``x_scale`` ``[M, K / bk]`` (one
    per token and group), ``wq`` ``[N, K]`` e4m3 with ``w_scale`` ``[N / bn, K / bk]``; one ``_scaled_mm`` per
    K slice (FP8 tensor-core products, fp32 accumulation), the scales applied to its fp32 result."""
    bn, bk = block
    m, k = xq.shape
    rows = -(-m // PAD_ROWS) * PAD_ROWS
    if rows != m:
        xq = torch.cat([xq, xq.new_zeros((rows - m, k))])
    one = torch.ones((), device=xq.device)
    out = torch.zeros((m, wq.shape[0]), dtype=torch.float32, device=xq.device)
    for j in range(k // bk):
        part = torch._scaled_mm(xq[:, j * bk:(j + 1) * bk].contiguous(), wq[:, j * bk:(j + 1) * bk].contiguous().t(),
                                scale_a=one, scale_b=one, out_dtype=torch.float32)[:m]
        out += part * x_scale[:, j:j + 1] * w_scale[:, j].repeat_interleave(bn)[None, :]
    return out


def emulated_fp8_gemm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """bf16 ``[M, N]``: what ``models.fp8.fp8_forward`` computes for one linear (no bias)."""
    xdq = fake_quantize_activation(x, recipe.activation_block_size, recipe.use_activation_pow2_scale)
    return (xdq @ dequantize_weight(wq, w_scale).t()).to(OUTPUT_DTYPE)


def real_fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """bf16 ``[..., N]``: the real kernel's version of ``emulated_fp8_gemm`` on ``x`` ``[..., K]``."""
    xq, x_scale = quantize_activation(x.reshape(-1, x.shape[-1]), recipe.activation_block_size,
                                      recipe.use_activation_pow2_scale)
    out = real_fp8_gemm(xq, x_scale, wq, w_scale, recipe.weight_block_size)
    return out.to(OUTPUT_DTYPE).reshape(*x.shape[:-1], wq.shape[0])


def emulated_fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """``emulated_fp8_gemm`` on ``x`` ``[..., K]`` flattened to 2-D: the same FP8 GEMM as ``fp8_forward``'s through
    another fp32 path (its own rounding noise)."""
    out = emulated_fp8_gemm(x.reshape(-1, x.shape[-1]), wq, w_scale, recipe)
    return out.reshape(*x.shape[:-1], wq.shape[0])


@contextlib.contextmanager
def real_fp8_forward(gpt_model, recipe: Fp8Recipe, gemm: Callable = real_fp8_linear):
    """Within the block the FP8 linears of ``gpt_model`` (one device: no TP, no sequence parallelism) run
    ``gemm`` (default the real FP8 GEMM) on the bytes ``fp8_forward`` would use (``_forward_impl`` replaced,
    as there)."""
    patched = []
    try:
        for _, module in fp8_linears(gpt_model, recipe):
            q, scale = quantize_weight(module.weight, recipe.weight_block_size, recipe.use_weight_pow2_scale)

            def impl(input, weight, bias=None, *args, _q=q, _scale=scale, **kwargs):  # noqa: A002 (Megatron's names)
                out = gemm(input, _q, _scale, recipe)
                return out if bias is None else out + bias.to(OUTPUT_DTYPE)

            patched.append((module, module.__dict__.get("_forward_impl")))
            module._forward_impl = impl
        yield
    finally:
        for module, previous in patched:
            if previous is None:
                del module._forward_impl
            else:
                module._forward_impl = previous


def gemm_residuals(gpt_model, recipe: Fp8Recipe, inputs: Dict[str, torch.Tensor]) -> Dict:
    """Per FP8 linear, on its captured input: max |real - emulated| relative to max |emulated| and the share of
    bf16 outputs that are bit-equal; the worst and the overall figures."""
    worst_rel, equal, total = 0.0, 0, 0
    for name, module in fp8_linears(gpt_model, recipe):
        x = inputs[name].reshape(-1, inputs[name].shape[-1])
        q, scale = quantize_weight(module.weight, recipe.weight_block_size, recipe.use_weight_pow2_scale)
        emulated, real = emulated_fp8_gemm(x, q, scale, recipe), real_fp8_linear(x, q, scale, recipe)
        diff = (real.float() - emulated.float()).abs()
        worst_rel = max(worst_rel, (diff.max() / emulated.float().abs().max().clamp_min(1e-30)).item())
        equal += int((real.view(torch.int16) == emulated.view(torch.int16)).sum())
        total += real.numel()
    return {"gemm_rel_max": worst_rel, "gemm_equal_fraction": equal / max(total, 1), "gemm_outputs": total}


def _captured_inputs(model, ids: torch.Tensor, recipe: Fp8Recipe) -> Dict[str, torch.Tensor]:
    """Each FP8 linear's input in one bf16-autocast forward (the activations the GEMMs really see)."""
    gpt, inputs, hooks = unwrap(model), {}, []

    def keep(name: str, args, kwargs) -> None:
        inputs.setdefault(name, (args[0] if args else kwargs["input"]).detach())

    for name, module in fp8_linears(gpt, recipe):
        hooks.append(module.register_forward_pre_hook(lambda _m, args, kwargs, _n=name: keep(_n, args, kwargs),
                                                      with_kwargs=True))
    try:
        with torch.no_grad(), precision_context(torch.bfloat16, torch.float32):
            forward_logits(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs


def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), precision_context(torch.bfloat16, torch.float32):
        logits = forward_logits(model, ids).float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def measure_fp8_kernel_residual(model_dir: str, seqs: int, seq_len: int, recipe: Fp8Recipe) -> Dict:
    """The kernel residual on ``seqs`` random sequences of ``seq_len`` tokens: per linear (``gemm_residuals``)
    and in log-probs, |lp_real - lp_emulated| beside the emulation's own fp32 noise |lp_emulated_2d -
    lp_emulated| (``emulated_fp8_linear``: any two fp32 paths differ by that much, since a one-step change of a
    bf16 activation can move its e4m3 rounding) and the FP8 gap itself |lp_emulated - lp_bf16|, mean and max;
    plus forward seconds. True fp32 GEMMs (TF32 off); one device, a one-rank model-parallel state."""
    configure_fp32_matmul(torch.float32)
    state.initialize_model_parallel(state.Layout(world_size=1))
    cuda = torch.cuda.is_available()
    model, shape = build_from_hf(model_dir)
    model.eval()
    gpt, device = unwrap(model), model_device(model)
    ids = torch.randint(0, shape.vocab_size, (seqs, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "weight_block_size": list(recipe.weight_block_size), "activation_block_size": recipe.activation_block_size,
              "num_fp8_linears": len(list(fp8_linears(gpt, recipe)))}
    result.update(gemm_residuals(gpt, recipe, _captured_inputs(model, ids, recipe)))
    lp: Dict[str, torch.Tensor] = {}
    contexts = {"bf16": contextlib.nullcontext, "emulated": lambda: fp8_forward(gpt, recipe),
                "real": lambda: real_fp8_forward(gpt, recipe),
                "emulated_2d": lambda: real_fp8_forward(gpt, recipe, emulated_fp8_linear)}
    for name, context in contexts.items():
        start = time.perf_counter()
        with context():
            lp[name] = _log_probs(model, ids)
        if cuda:
            torch.cuda.synchronize()
        result[f"forward_s_{name}"] = time.perf_counter() - start
    pairs = {"residual": ("real", "emulated"), "fp32_noise": ("emulated_2d", "emulated"), "fp8_gap": ("emulated", "bf16")}
    for key, (a, b) in pairs.items():
        diff = (lp[a] - lp[b]).abs()
        result[f"lp_{key}_abs_mean"], result[f"lp_{key}_abs_max"] = diff.mean().item(), diff.max().item()
    result["tokens"] = int(lp["bf16"].numel())
    return result
