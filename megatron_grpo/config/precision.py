"""``policy.precision``: the trainer's, the generator's and the shadow's precisions, and FP8 rollouts' settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from megatron_grpo.models.fp8 import Fp8Recipe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes weights and the trainer's GEMMs can have."""
FP8 = "fp8"
"""The generator's and the shadow's FP8 (NeMo-RL's ``generation.vllm_cfg.precision: fp8``): blockwise e4m3
weights and per-token-group e4m3 activations around bf16 (``models/fp8.py``; settings ``policy.precision.fp8``)."""
PRECISIONS = {**DTYPES, FP8: torch.float8_e4m3fn}
"""What a generation or shadow precision can be. ``fp8`` maps to ``torch.float8_e4m3fn`` where a torch dtype
stands for a precision (``models/forward.py`` turns it into bf16 autocast plus the FP8 linears)."""


def to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ``"fp8"`` -> ``torch.float8_e4m3fn`` (a precision token)."""
    return PRECISIONS[name]


def _check(key: str, value: Optional[str], choices, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value == FP8 and FP8 not in choices:
        raise ValueError(f"{key}=fp8: FP8 is a generation / shadow precision here (policy.precision.generation_dtype, "
                         f"shadow_dtype); FP8 training GEMMs are Transformer Engine's (policy.megatron_cfg.fp8)")
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class Fp8Config:
    """FP8 rollouts (``generation_dtype: fp8``) and the FP8 shadow: how weights and activations are quantized.
    NeMo-RL's names; what the field's FP8 rollouts use by default (DeepSeek-V3's format, vLLM's block FP8)."""

    weight_block_size: List[int] = field(default_factory=lambda: [128, 128])
    """[rows, cols] of one weight block with its own fp32 scale (e4m3fn values, scale = block amax / 448). Must
    tile every quantized weight's TP / EP shard, and, where there is a fused QKV, its rows must divide the
    attention head dim (the QKV weight's blocks then stay inside one head, so they map to the generator's
    q / k / v blocks; multi-latent attention has no fused QKV and no such rule)."""
    activation_block_size: int = 128
    """Input features per activation group: one scale per token and group, computed on the fly (dynamic).
    vLLM's block FP8 uses weight_block_size[1] here."""
    use_weight_pow2_scale: bool = False
    """Round each weight block's scale up to a power of two."""
    use_activation_pow2_scale: bool = False
    """Round each activation group's scale up to a power of two."""
    num_first_layers_in_bf16: int = 0
    """The first N decoder layers keep bf16 linears (a common guard for the most sensitive layers)."""
    num_last_layers_in_bf16: int = 0
    """The last N decoder layers keep bf16 linears."""

    def __post_init__(self):
        key = "policy.precision.fp8"
        if len(self.weight_block_size) != 2 or any(int(b) < 1 for b in self.weight_block_size):
            raise ValueError(f"{key}.weight_block_size must be two positive ints [rows, cols], "
                             f"got {self.weight_block_size!r}")
        self.weight_block_size = [int(b) for b in self.weight_block_size]
        if self.activation_block_size < 1:
            raise ValueError(f"{key}.activation_block_size must be >= 1, got {self.activation_block_size}")
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            if getattr(self, name) < 0:
                raise ValueError(f"{key}.{name} must be >= 0, got {getattr(self, name)}")

    def recipe(self) -> Fp8Recipe:
        return Fp8Recipe(tuple(self.weight_block_size), self.activation_block_size, self.use_weight_pow2_scale,
                         self.use_activation_pow2_scale, self.num_first_layers_in_bf16, self.num_last_layers_in_bf16)


@dataclass
class PrecisionConfig:
    """Trainer and generator precisions (the knobs of the write-up)."""

    params_dtype: str = "float32"
    """Dtype of the model weights: float32 (master weights), bfloat16 or float16."""
    compute_dtype: str = "float32"
    """Dtype of the trainer's forward GEMMs (CPU: autocast; GPU: autocast / TE GEMMs)."""
    generation_dtype: Optional[str] = None
    """The generator's precision: float32, bfloat16, float16 or fp8 (blockwise FP8 weights and activations
    around bf16, settings under ``fp8``); null = compute_dtype (precision-matched, beta = 0)."""
    shadow_dtype: Optional[str] = None
    """Precision of the no-grad shadow forward that measures beta (fp8 allowed, as generation_dtype); null =
    generation_dtype."""
    shadow_router_dtype: Optional[str] = None
    """MoE only: the generator's router-gate precision, used by the shadow forward; null = shadow_dtype, or
    bfloat16 when that is fp8 (routers stay bf16 in FP8 models, as vLLM's)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 generation / shadow settings (used when generation_dtype or shadow_dtype is fp8)."""
    initial_loss_scale: float = 65536.0
    """fp16 only: starting dynamic loss scale."""
    min_loss_scale: float = 1.0
    """fp16 only: the loss scale never goes below this."""
    loss_scale_window: int = 100
    """fp16 only: steps without overflow before the scale doubles."""
    hysteresis: int = 1
    """fp16 only: consecutive overflows before the scale halves (Megatron's default is 2)."""
    master_weights: bool = True
    """Half params only: Megatron's optimizer keeps fp32 main params and moments and copies them
    into the params after each update (Megatron's default). false: the optimizer updates the
    bf16/fp16 params (and keeps its moments) in their own dtype, as the write-up's
    ``DTYPE=bfloat16`` run: updates smaller than half a bf16 ulp of a weight are lost."""

    def __post_init__(self):
        key = "policy.precision"
        _check(f"{key}.params_dtype", self.params_dtype, DTYPES)
        _check(f"{key}.compute_dtype", self.compute_dtype, DTYPES)
        _check(f"{key}.generation_dtype", self.generation_dtype, PRECISIONS, allow_none=True)
        _check(f"{key}.shadow_dtype", self.shadow_dtype, PRECISIONS, allow_none=True)
        _check(f"{key}.shadow_router_dtype", self.shadow_router_dtype, DTYPES, allow_none=True)
        if self.generation_dtype is None:
            self.generation_dtype = self.compute_dtype
        if self.shadow_dtype is None:
            self.shadow_dtype = self.generation_dtype
        if self.shadow_router_dtype is None:
            self.shadow_router_dtype = "bfloat16" if self.shadow_dtype == FP8 else self.shadow_dtype
        if DTYPES[self.compute_dtype].itemsize > DTYPES[self.params_dtype].itemsize:
            raise ValueError(f"{key}.compute_dtype={self.compute_dtype} is wider than params_dtype="
                             f"{self.params_dtype}: computing above the weights' precision is not supported")
        for name in ("generation_dtype", "shadow_dtype"):  # both run on the params (Float16Module)
            if PRECISIONS[getattr(self, name)].itemsize > DTYPES[self.params_dtype].itemsize:
                raise ValueError(
                    f"{key}.{name}={getattr(self, name)} is wider than {key}.params_dtype="
                    f"{self.params_dtype}: the shadow forward, the megatron generator and the parity probe's trainer "
                    f"side run on the {self.params_dtype} weights, so it would silently run in {self.params_dtype} "
                    f"(beta exactly 0). Set {key}.params_dtype={getattr(self, name)} or {name} no wider")
        if self.hysteresis < 1:
            raise ValueError(f"{key}.hysteresis must be >= 1, got {self.hysteresis}")
        if {self.params_dtype, self.compute_dtype} == {"bfloat16", "float16"}:
            raise ValueError(f"{key}: params_dtype and compute_dtype mix bfloat16 and float16")
        if FP8 in (self.generation_dtype, self.shadow_dtype) and self.params_dtype == "float16":
            raise ValueError(f"{key}.params_dtype=float16 with fp8 generation / shadow: FP8 models run in bf16 "
                             f"around their FP8 GEMMs; use float32 or bfloat16 params")

    @property
    def needs_shadow(self) -> bool:
        """The shadow forward runs only when it differs from the trainer's own forward."""
        return self.shadow_dtype != self.compute_dtype

    @property
    def uses_fp8(self) -> bool:
        """The generator or the shadow runs FP8 linears."""
        return FP8 in (self.generation_dtype, self.shadow_dtype)


def check_vllm_fp8(p: PrecisionConfig, backend: str) -> None:
    """``generation_dtype: fp8`` on vLLM (``backend`` vllm / vllm_server): the recipe must be what vLLM 0.32's
    block FP8 computes. It quantizes activations per token in groups of ``weight_block_size[0]`` and its GEMMs
    take them per block column, so blocks are square and the activation group is their side; it rounds
    activation scales to powers of two only on its DeepGEMM UE8M0 path, which also re-quantizes the weights to
    power-of-two scales (``models/fp8_hf.vllm_env``)."""
    if p.generation_dtype != FP8 or backend == "megatron":
        return
    f, key = p.fp8, "policy.precision.fp8"
    if not f.activation_block_size == f.weight_block_size[0] == f.weight_block_size[1]:
        raise ValueError(f"{key}.activation_block_size={f.activation_block_size} with weight_block_size="
                         f"{f.weight_block_size} and generation.backend={backend}: vLLM's block FP8 quantizes "
                         f"activations in groups of weight_block_size[0] and multiplies them per block column; use "
                         f"square blocks and activation_block_size equal to their side (e.g. [128, 128] and 128)")
    if f.use_activation_pow2_scale and not f.use_weight_pow2_scale:
        raise ValueError(f"{key}.use_activation_pow2_scale=true needs {key}.use_weight_pow2_scale=true with "
                         f"generation.backend={backend}: vLLM rounds activation scales to powers of two only on its "
                         "DeepGEMM UE8M0 path, which re-quantizes the weights to power-of-two scales too")
