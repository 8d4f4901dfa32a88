"""FP8 weights under Hugging Face names: the format an FP8 generator (vLLM's block FP8) loads.

An FP8 HF checkpoint (DeepSeek-V3's, Qwen3-*-FP8's: what vLLM's ``fp8`` method reads) holds each quantized
linear as ``<module>.weight`` (float8_e4m3fn ``[N, K]``) beside ``<module>.weight_scale_inv`` (fp32
``[ceil(N / bn), ceil(K / bk)]``: weight = q * scale, block by block), and a ``quantization_config``
(``quant_method: fp8``, ``fmt: e4m3``, ``activation_scheme: dynamic``, ``weight_block_size: [bn, bk]``,
``modules_to_not_convert``); everything else (embeddings, norms, routers, the output layer, bf16 layers)
stays bf16.

The weight push sends exactly that (``rollout/transfer/weight_sync.py``): each rank quantizes only its own
TP / EP shards (``models.fp8.quantize_weight``), and the fp8 bytes and their scales are gathered and mapped to
HF names by the same ``weights.unshard`` as bf16 tensors. Blocks never straddle a shard and their rows divide
``head_dim`` (checked at config time), so Megatron's fused layouts map block for block: QKV is interleaved per
query group in whole heads, fc1 is ``[gate shard; up shard]`` per TP rank, and the scale grid follows the same
permutation in units of blocks (``block_shape``). The quantized bytes are therefore those of the HF weight
quantized whole, and vLLM loads them without re-quantizing (``vllm_env``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Set

from megatron_grpo.models.fp8 import FP8_DTYPE, Fp8Recipe, fp8_linears, quantized_layer_ids
from megatron_grpo.models.qwen3 import ModelShape
from megatron_grpo.models.weight_maps import RankPlacement, param_maps

SCALE_SUFFIX = "_scale_inv"
"""``q_proj.weight`` -> ``q_proj.weight_scale_inv`` (vLLM's ``Fp8LinearMethod`` parameter name)."""
MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                    "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
"""The Megatron linears of a decoder layer (``models.fp8.fp8_linears`` patches them all): attention's fused QKV or
MLA's projections, the output projection, the MLP's, shared experts' and routed experts' fc1 / fc2."""


def scale_name(hf_weight_name: str) -> str:
    return hf_weight_name + SCALE_SUFFIX


def block_shape(shape: ModelShape, block: Sequence[int]) -> ModelShape:
    """``shape`` in units of weight blocks along the output dimension: ``weights.unshard`` of scale grids
    (QKV's per-group split works in head_dim / bn rows per head; fc1's gate / up halves, column and row
    splits need no shape, so neither does multi-latent attention, which has no fused QKV)."""
    if shape.is_mla:
        return shape
    assert shape.head_dim % block[0] == 0, f"block rows {block[0]} do not divide head_dim {shape.head_dim}"
    return dataclasses.replace(shape, head_dim=shape.head_dim // block[0])


def fp8_param_names(gpt_model, recipe: Fp8Recipe) -> Set[str]:
    """Names (``gpt_model.named_parameters()``, this rank's) of the weights the FP8 forward quantizes:
    ``models.fp8.fp8_linears`` (decoder linears and experts, minus the bf16 first / last layers)."""
    ids = {id(p): n for n, p in gpt_model.named_parameters()}
    return {ids[id(module.weight)] for _, module in fp8_linears(gpt_model, recipe)}


def layer_linear_modules(shape: ModelShape, layer: int) -> List[str]:
    """The HF modules of decoder layer ``layer``'s linears (``model.layers.<i>.self_attn.q_proj``, ...; MLA's
    ``q_a_proj`` / ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; shared experts'
    projections), read off the weight maps, with a MoE layer's routed experts as one ``<moe>.experts`` module:
    vLLM's fused experts, which its skip check matches by that name (``mlp.experts``, Mixtral's
    ``block_sparse_moe.experts``)."""
    place = RankPlacement(layer_offset=layer, num_local_layers=1, pre_process=False, post_process=False)
    out: List[str] = []
    for pm in param_maps(shape, place):
        module, _, leaf = pm.mcore_name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in MEGATRON_LINEARS:
            continue
        names = [f"model.layers.{layer}.{shape.moe_prefix}.experts"] if pm.expert else [
            n[:-len(".weight")] for n in pm.hf_names]
        out += [n for n in names if n not in out]
    return out


def modules_to_not_convert(recipe: Fp8Recipe, shape: ModelShape) -> List[str]:
    """The HF modules an FP8 generator must keep in bf16 (vLLM matches them exactly): every MoE router
    (``mlp.gate`` / ``block_sparse_moe.gate``: Qwen3-MoE's would be quantized, the trainer's is bf16) and the
    linears of the bf16 first / last layers (``layer_linear_modules``). Embeddings and the output layer are not
    quantized anyway."""
    fp8_layers = set(quantized_layer_ids(shape.num_layers, recipe))
    out = []
    for i in range(shape.num_layers):
        if i not in fp8_layers:
            out += layer_linear_modules(shape, i)
        if shape.is_moe_layer(i):
            out.append(f"model.layers.{i}.{shape.moe_prefix}.gate")
    return out


def hf_quantization_config(recipe: Fp8Recipe, shape: ModelShape) -> Dict:
    """The ``quantization_config`` of an FP8 HF checkpoint holding the pushed tensors (vLLM's ``Fp8Config``
    reads it: an engine starts with it as ``hf_overrides``). ``scale_fmt: ue8m0`` (DeepSeek-V3.1's key:
    power-of-two scales) with both pow2 keys (``vllm_env``)."""
    out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": list(recipe.weight_block_size),
           "modules_to_not_convert": modules_to_not_convert(recipe, shape)}
    if _pow2(recipe):
        out["scale_fmt"] = "ue8m0"
    return out


def _pow2(recipe: Fp8Recipe) -> bool:
    return recipe.use_weight_pow2_scale and recipe.use_activation_pow2_scale


def vllm_env(recipe: Fp8Recipe) -> Dict[str, str]:
    """The engines' environment for this recipe. vLLM 0.32's DeepGEMM block-FP8 path (Hopper / Blackwell with
    DeepGEMM installed) re-quantizes every loaded block weight to power-of-two (UE8M0) scales and quantizes
    activations with power-of-two scales when ``VLLM_USE_DEEP_GEMM_E8M0`` is on (its default): that is our
    recipe only with both pow2 keys; otherwise it is switched off, so the engine keeps the pushed bytes and
    amax / 448 activation scales. (Its other kernels, CUTLASS and Triton, keep the bytes and never round
    activation scales to powers of two.)"""
    return {"VLLM_USE_DEEP_GEMM_E8M0": "1" if _pow2(recipe) else "0"}


def engine_keeps_bytes(name: str, tensor, quantization_config: Dict) -> bool:
    """Whether a vLLM engine holds pushed tensor ``name`` byte for byte (so its ``/weight_checker`` digest can
    be compared with ours). Scales: no (DeepGEMM keeps them in its TMA-aligned layout). FP8 weights: yes,
    unless DeepGEMM re-quantizes them to UE8M0 scales (``scale_fmt: ue8m0``), which keeps their values but, for
    a block whose largest e4m3 magnitude rounded down to 224, not their bytes (2q at half the scale).
    Everything else is loaded as it is."""
    if name.endswith(SCALE_SUFFIX):
        return False
    return not (tensor.dtype == FP8_DTYPE and quantization_config.get("scale_fmt") == "ue8m0")
