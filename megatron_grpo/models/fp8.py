"""FP8 rollouts' quantization, once: blockwise e4m3 weights, per-token-group activations, the FP8 forward.

What the field's FP8 rollouts do (NeMo-RL, verl, slime, miles; vLLM's ``fp8`` with ``weight_block_size``):
the decoder's linear weights are quantized from the trainer's weights at every push into float8_e4m3fn
blocks of ``weight_block_size`` = [rows, cols] (128 x 128) with one fp32 scale per block
(``weight_scale_inv``: weight ~= q * scale); activations are quantized on the fly per token in groups of
``activation_block_size`` (1 x 128) consecutive input features; the GEMM multiplies the fp8 values,
accumulates in fp32, applies the two scales and writes bf16. Embeddings, norms, routers and the output
layer stay in bf16.

This module is the only quantizer of the package: the weight push, the megatron generator, the shadow
forward and the parity probe's checksums all take their bytes from :func:`quantize_weight`, so the
generator and the shadow see the same quantized weights by construction.

Conventions (pinned by tests/test_fp8.py against a reference written in the test):
- a block's scale is ``amax / 448`` in fp32 (448 = e4m3fn's largest finite value); a block whose amax is 0
  gets scale 1; with ``pow2`` the scale is rounded up to a power of two (``2**ceil(log2(amax / 448))``,
  so no value overflows), as DeepSeek's / NeMo-RL's ``use_*_pow2_scale``;
- values are ``w / scale`` in fp32, clamped to [-448, 448], then rounded to the nearest e4m3fn value (ties to
  even: torch's cast);
- weights are quantized from their bf16 rounding (the generator's weights in the field are bf16; for a bf16
  trainer this is the identity);
- the FP8 GEMM is emulated exactly up to summation order: both operands dequantized to fp32 (q * scale), one
  fp32 matmul, the output rounded to bf16, the bias added in bf16. A real block-scaled kernel accumulates
  each 128-wide slice in fp32 and applies the scales per slice: the two differ by fp32 round-off only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
FP8_DTYPE = torch.float8_e4m3fn
OUTPUT_DTYPE = torch.bfloat16
"""What an FP8 GEMM writes, and the dtype of everything around the FP8 GEMMs (as vLLM's fp8 models)."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How weights and activations are quantized (``policy.precision.fp8``, resolved)."""

    weight_block_size: Tuple[int, int] = (128, 128)
    """[rows (output features), cols (input features)] of one weight block."""
    activation_block_size: int = 128
    """Input features per activation group (one scale per token and group)."""
    use_weight_pow2_scale: bool = False
    use_activation_pow2_scale: bool = False
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0


def block_scales(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """fp32 dequantization scales (``weight_scale_inv``) from per-block absolute maxima. The divisor is a
    tensor: CUDA turns division by a Python scalar into multiplication by its reciprocal, 1 ulp off true
    division (vLLM's kernels) for about half of all bf16 amax values; tensor / tensor divides on every device."""
    scale = amax.float() / torch.full((), E4M3_MAX, dtype=torch.float32, device=amax.device)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _to_e4m3(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_weight(weight: torch.Tensor, block: Sequence[int], pow2: bool = False
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> (q [N, K] float8_e4m3fn, scale_inv [N / bn, K / bk] fp32); the blocks must tile
    the weight exactly (validated at config time; an assert here)."""
    bn, bk = block
    n, k = weight.shape
    assert n % bn == 0 and k % bk == 0, f"block {bn}x{bk} does not tile a {n}x{k} weight"
    w = weight.detach().to(torch.bfloat16).float().reshape(n // bn, bn, k // bk, bk)
    scale = block_scales(w.abs().amax(dim=(1, 3)), pow2)
    q = _to_e4m3(w / scale[:, None, :, None])
    return q.reshape(n, k), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight ``q * scale`` from :func:`quantize_weight`'s output (block size read off the shapes)."""
    n, k = q.shape
    rows, cols = scale.shape
    blocks = q.float().reshape(rows, n // rows, cols, k // cols)
    return blocks.mul_(scale[:, None, :, None]).reshape(n, k)  # in place: one fp32 copy at a time


def quantize_activation(x: torch.Tensor, group: int, pow2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] -> (q [..., K] float8_e4m3fn, scale [..., K / group] fp32): one scale per token and group
    of ``group`` consecutive features, from the bf16 activation (what the generator's GEMM receives)."""
    *lead, k = x.shape
    assert k % group == 0, f"activation group {group} does not divide {k} features"
    xg = x.detach().to(torch.bfloat16).float().reshape(*lead, k // group, group)
    scale = block_scales(xg.abs().amax(dim=-1), pow2)
    return _to_e4m3(xg / scale[..., None]).reshape(*lead, k), scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    *lead, k = q.shape
    groups = scale.shape[-1]
    return (q.float().reshape(*lead, groups, k // groups) * scale[..., None]).reshape(*lead, k)


def fake_quantize_activation(x: torch.Tensor, group: int, pow2: bool = False) -> torch.Tensor:
    """fp32 values of ``x`` after an fp8 round trip (what the FP8 GEMM multiplies)."""
    return dequantize_activation(*quantize_activation(x, group, pow2))


# ---- which layers, and the forward ---------------------------------------------------------------------------


def quantized_layer_ids(num_layers: int, recipe: Fp8Recipe) -> range:
    """Global (0-based) decoder layer numbers whose linears run in FP8; the first / last ones stay bf16."""
    return range(recipe.num_first_layers_in_bf16, num_layers - recipe.num_last_layers_in_bf16)


_LINEARS = ("ColumnParallelLinear", "RowParallelLinear")
"""Megatron-Core's local tensor-parallel linears (matched by class name: no megatron import here, models/ is
imported by light commands). Transformer Engine's linears are not patched: the FP8 forward needs the local spec."""


def _is_linear(module) -> bool:
    return any(cls.__name__ in _LINEARS for cls in type(module).__mro__)


def fp8_linears(gpt_model, recipe: Fp8Recipe) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(name, module) of this rank's FP8 linears: every Megatron column/row-parallel linear inside a decoder
    layer (attention projections, MLA's too, MLP, routed and shared experts), except those of the bf16 first / last
    layers. The router, norms, embedding and output layer are not linears of this kind or not in a layer."""
    layers = gpt_model.decoder.layers
    keep = quantized_layer_ids(gpt_model.config.num_layers, recipe)
    for layer in layers:
        if layer.layer_number - 1 not in keep:  # Megatron's layer_number is global and 1-based
            continue
        for name, module in layer.named_modules():
            if _is_linear(module):
                yield f"decoder.layers.{layer.layer_number - 1}.{name}", module


@dataclass
class QuantizedWeight:
    """One linear's fp8 bytes and block scales (this rank's shard), as pushed and as the FP8 forward uses them."""

    q: torch.Tensor
    """[N_local, K_local] float8_e4m3fn"""
    scale_inv: torch.Tensor
    """[N_local / bn, K_local / bk] fp32"""


def quantize_model(gpt_model, recipe: Fp8Recipe) -> Dict[str, QuantizedWeight]:
    """This rank's FP8 weights, keyed by :func:`fp8_linears`' names (never more than this rank's shards)."""
    out = {}
    for name, module in fp8_linears(gpt_model, recipe):
        q, scale = quantize_weight(module.weight, recipe.weight_block_size, recipe.use_weight_pow2_scale)
        out[name] = QuantizedWeight(q, scale)
    return out


def _fp8_impl(original, quantized: QuantizedWeight, recipe: Fp8Recipe, hold_dequantized: bool):
    """A stand-in for a Megatron linear's ``_forward_impl`` (the GEMM, with the sequence-parallel all-gather
    that the original does around it) computing the emulated FP8 GEMM. The fp32 weight it multiplies is
    dequantized when the linear runs and freed after (one linear's at a time), or once, held for the block."""
    held = dequantize_weight(quantized.q, quantized.scale_inv) if hold_dequantized else None

    def impl(input, weight, bias=None, *args, **kwargs):  # noqa: A002 (Megatron's keyword names)
        xq = fake_quantize_activation(input, recipe.activation_block_size, recipe.use_activation_pow2_scale)
        w = held if held is not None else dequantize_weight(quantized.q, quantized.scale_inv)
        with torch.autocast(xq.device.type, enabled=False):
            out = original(xq, w, None, *args, **kwargs).to(OUTPUT_DTYPE)
        return out if bias is None else out + bias.to(OUTPUT_DTYPE)

    return impl


@contextlib.contextmanager
def fp8_forward(gpt_model, recipe: Fp8Recipe, weights: Optional[Dict[str, QuantizedWeight]] = None,
                hold_dequantized: bool = False):
    """Within the block, the FP8 linears of ``gpt_model`` compute the emulated FP8 GEMM on ``weights`` (default:
    this rank's current weights, quantized on entry). No-grad forwards only. The caller provides bf16 around the
    GEMMs (autocast), as vLLM runs the rest of an fp8 model in bf16. The block holds the e4m3 bytes and scales
    (~1 B per weight); each linear dequantizes its own weight to fp32 when it runs, unless ``hold_dequantized``
    (the megatron generator's decode loop, which runs every linear once per token: 4 B per weight more, held)."""
    weights = quantize_model(gpt_model, recipe) if weights is None else weights
    patched: List[Tuple[torch.nn.Module, object]] = []
    try:
        for name, module in fp8_linears(gpt_model, recipe):
            previous = module.__dict__.get("_forward_impl")
            module._forward_impl = _fp8_impl(module._forward_impl, weights[name], recipe, hold_dequantized)
            patched.append((module, previous))
        yield weights
    finally:
        for module, previous in patched:
            if previous is None:
                del module._forward_impl
            else:
                module._forward_impl = previous


# ---- the model's recipe ---------------------------------------------------------------------------------------


def attach_recipe(gpt_model, recipe: Optional[Fp8Recipe]) -> None:
    """Gives ``gpt_model`` (the bare ``GPTModel``) the FP8 settings its FP8 forwards use: set once, where the
    model is built (``models.build_from_hf(fp8_recipe=...)``, from ``policy.precision.fp8``), so that every
    forward that names the fp8 precision (shadow, megatron generator, parity probe) quantizes the same way."""
    gpt_model.fp8_recipe = recipe


def recipe_of(gpt_model) -> Fp8Recipe:
    """The recipe :func:`attach_recipe` gave the model; a ``ValueError`` when it was built without one."""
    recipe = getattr(gpt_model, "fp8_recipe", None)
    if recipe is None:
        raise ValueError("an fp8 forward of a model built without FP8 settings: build it with "
                         "build_from_hf(..., fp8_recipe=policy.precision.fp8.recipe())")
    return recipe
