"""Multi-latent attention (DeepSeek-V3) on Megatron-Core's local layers.

Megatron's ``MLASelfAttention`` with its local layer spec does not build as is, on either version:

- its core attention is given the key and value head sizes (``k_channels``, ``v_channels``), which
  only Transformer Engine's attention takes: ``latent_core_attention`` is Megatron's local
  ``DotProductAttention`` taking them (the value size is ``config.kv_channels`` = ``v_head_dim``);
- the latent norms (HF's ``q_a_layernorm``, ``kv_a_layernorm``): the local spec builds them as separate
  ``q_layernorm`` / ``kv_layernorm`` modules when ``config.qk_layernorm``, but 0.19 then also demands a
  norm fused into ``linear_q_proj`` when there is no q LoRA (Moonlight, DeepSeek-V2-Lite), a norm those
  models do not have (``mla_qk_norm_config.py``), and the local backend has no fused norm + linear, so it
  refuses to build. ``normed_column_linear`` is Megatron's ``ColumnParallelLinear`` with the RMSNorm of
  its input fused in front, as Transformer Engine's ``LayerNormColumnParallelLinear`` (same parameter
  name, ``layer_norm_weight``): the up projections take the latent norms, ``config.qk_layernorm`` is off
  and no separate norm is built, on both versions. Under sequence parallelism the norm sees this rank's
  tokens only, so its weight is tagged ``sequence_parallel`` (its gradient all-reduced over TP, as
  ``models/norm.py``'s norms).

Both classes are subclasses of the spec's own Megatron classes, made from them here (the module does
not import Megatron: ``models/`` stays light to import).
"""

from __future__ import annotations

import functools

import torch

from megatron_grpo.compat.megatron import identity_op, mla_without_te

LATENT_NORM_EPS = 1e-6
"""The latent norms' epsilon: transformers' (and DeepSeek's own code's) ``q_a_layernorm`` / ``kv_a_layernorm``
are ``DeepseekV3RMSNorm(rank)`` at its default 1e-6, whatever ``rms_norm_eps`` says (Moonlight: 1e-5)."""


@functools.lru_cache(maxsize=None)
def latent_core_attention(base: type) -> type:
    """Megatron's local ``DotProductAttention`` (``base``) accepting MLA's head sizes: it computes
    ``[q_nope; q_rope] . [k_nope; k_rope]`` for any key size and takes the value size from
    ``config.kv_channels``."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        base.__init__(self, *args, **kwargs)
        assert v_channels in (None, self.config.kv_channels), (v_channels, self.config.kv_channels)

    return type("LatentDotProductAttention", (base,), {"__init__": __init__, "takes_head_sizes": True,
                                                      "__doc__": latent_core_attention.__doc__})


@functools.lru_cache(maxsize=None)
def normed_column_linear(base: type) -> type:
    """``base`` (Megatron's ``ColumnParallelLinear``) with an RMSNorm of its input in front: input
    ``[s(/tp), b, in]`` -> ``rms_norm(x, eps=LATENT_NORM_EPS) * layer_norm_weight`` -> the column-parallel
    projection."""

    def __init__(self, input_size, output_size, *args, config, **kwargs):
        base.__init__(self, input_size, output_size, *args, config=config, **kwargs)
        weight = torch.ones(input_size, dtype=config.params_dtype, device=self.weight.device)
        self.layer_norm_weight = torch.nn.Parameter(weight)
        self.layer_norm_weight.sequence_parallel = bool(config.sequence_parallel)
        self.layer_norm_eps = LATENT_NORM_EPS

    def forward(self, input_, *args, **kwargs):
        normed = torch.nn.functional.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight, self.layer_norm_eps)
        return base.forward(self, normed, *args, **kwargs)

    return type("NormedColumnParallelLinear", (base,), {"__init__": __init__, "forward": forward,
                                                       "fuses_norm": True, "__doc__": normed_column_linear.__doc__})


def adapt_local_latent(spec, config) -> None:
    """A local MLA layer ``spec`` made buildable and equal to HF's (see the module doc); ``config``'s
    QK-layernorm is switched off (the norms live in the up projections) and its ``transformer_impl`` is
    ``local`` (0.16.1: unused here; 0.19: the backend MLA resolves its norms with)."""
    attention = spec.submodules.self_attention.submodules
    if not getattr(attention.core_attention, "takes_head_sizes", False):
        attention.core_attention = latent_core_attention(attention.core_attention)
    for name in ("linear_q_up_proj", "linear_kv_up_proj"):
        linear = getattr(attention, name)
        if not getattr(linear, "fuses_norm", False):
            setattr(attention, name, normed_column_linear(linear))
    attention.q_layernorm = attention.kv_layernorm = identity_op()
    config.qk_layernorm = False
    config.transformer_impl = "local"  # 0.19's MLA resolves its norm modules from this backend
    mla_without_te()
