"""The model families an HF checkpoint may bring, read into one ``ModelShape``.

| ``model_type`` | what differs from Llama (the base) |
|---|---|
| ``llama`` | the base: GQA, RMSNorm, SwiGLU, rope |
| ``qwen3`` / ``qwen3_moe`` | QK-norm; MoE: softmax router, top-k renormalised or not (``norm_topk_prob``) |
| ``qwen2`` | QKV bias; sliding window on the layers ``layer_types`` / ``max_window_layers`` name, when ``use_sliding_window`` |
| ``mistral`` | sliding window on every layer (``sliding_window``, null = none) |
| ``mixtral`` | Mistral + MoE: softmax top-2 renormalised, no shared experts, HF names ``block_sparse_moe.experts.N.w1/w3/w2`` |
| ``deepseek_v3`` | multi-latent attention (q / kv LoRA ranks, rope head dim), first ``first_k_dense_replace`` layers dense, MoE with shared experts, sigmoid router with ``e_score_correction_bias``, group-limited top-k, ``routed_scaling_factor``; YaRN rope |

Every HF config field that changes the model's math is either mapped here or refused by name
(``ValueError``); fields that only matter to HF's own training (``router_aux_loss_coef``,
``output_router_logits``) or to decoding tricks the trainer does not use (DeepSeek's multi-token
prediction layers, which never change the main logits) are left out, as documented per family.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "qwen2", "mistral", "mixtral", "deepseek_v3")


@dataclass
class ModelShape:
    """What the builder (``models/qwen3.py``) and the weight maps (``models/weight_maps.py``) need of an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    qk_norm: bool = True
    """RMSNorm on each head's queries and keys (Qwen3: ``q_norm`` / ``k_norm``); Llama has none. With MLA:
    the norms of the q and kv latents (``q_a_layernorm`` / ``kv_a_layernorm``, Megatron's QK-layernorm)."""
    qkv_bias: bool = False
    """Biases on q / k / v (Qwen2), none on the output projection."""
    sliding_window: int = 0
    """Keys a query sees, itself included (HF's ``sliding_window``); 0 = full causal attention."""
    window_layers: Tuple[bool, ...] = ()
    """Which layers use the sliding window (Qwen2's ``layer_types``); () = all of them."""
    first_dense_layers: int = 0
    """MoE models: the first layers are dense MLPs of ``ffn_hidden_size`` (DeepSeek's ``first_k_dense_replace``)."""
    shared_expert_ffn_hidden_size: int = 0
    """FFN width of the shared experts every token passes through (DeepSeek: ``n_shared_experts`` x
    ``moe_intermediate_size``); 0 = none."""
    router_score_function: str = "softmax"
    """softmax | sigmoid (DeepSeek-V3)."""
    router_expert_bias: bool = False
    """A per-expert bias added to the scores for the top-k choice only (``e_score_correction_bias``)."""
    router_num_groups: int = 0
    """Group-limited routing: experts in this many groups (``n_group``); 0 = no groups."""
    router_group_topk: int = 0
    """Groups each token may route to (``topk_group``)."""
    router_scaling_factor: float = 1.0
    """Routed experts' weights are multiplied by it (``routed_scaling_factor``)."""
    q_lora_rank: int = 0
    """MLA: the queries' latent rank (``q_lora_rank``); 0 = queries projected directly (``q_proj``)."""
    kv_lora_rank: int = 0
    """MLA: the keys' and values' latent rank; > 0 means multi-latent attention."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    yarn: Dict[str, float] = field(default_factory=dict)
    """MLA's YaRN rope scaling (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim); empty = plain rope."""
    moe_prefix: str = "mlp"
    """The HF module of a MoE block: ``mlp`` (Qwen3-MoE, DeepSeek) or ``block_sparse_moe`` (Mixtral)."""
    expert_proj: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """HF names of an expert's gate, up and down projections (Mixtral: ``w1``, ``w3``, ``w2``)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether (0-based, global) decoder layer ``layer`` holds experts."""
        return self.is_moe and layer >= self.first_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def attention_params(self) -> Tuple[int, int]:
        """(split over TP, replicated) parameters of one layer's attention with its input and pre-MLP norms:
        fused QKV (+ Qwen2's biases) and output projection, Qwen3's q / k norms; or multi-latent attention's
        projections (Megatron's local spec splits the down projections over TP too; TE duplicates them)
        and the latent norms (the memory plan's count, ``trainer/plan.py``)."""
        h, heads = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = self.q_lora_rank * (h + heads * qk) if self.q_lora_rank else heads * qk * h
            kv = (self.kv_lora_rank + self.qk_rope_head_dim) * h + heads * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
            return q + kv + heads * self.v_head_dim * h, 2 * h + self.q_lora_rank + self.kv_lora_rank
        qkv_rows = (heads + 2 * self.num_kv_heads) * self.head_dim
        split = qkv_rows * (h + self.qkv_bias) + heads * self.head_dim * h
        return split, 2 * h + (2 * self.head_dim if self.qk_norm else 0)  # Qwen3's q / k norms; Llama has none

    def largest_attention_tensor(self) -> int:
        """Elements of the largest HF attention tensor: q / o projections, or MLA's q_b_proj (q_proj),
        kv_a_proj_with_mqa, kv_b_proj and o_proj."""
        h, heads = self.hidden_size, self.num_heads
        if not self.is_mla:
            return heads * self.head_dim * h
        return max(heads * self.head_dim * (self.q_lora_rank or h), (self.kv_lora_rank + self.qk_rope_head_dim) * h,
                   heads * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank, heads * self.v_head_dim * h)

    def kv_cache_elements_per_token(self) -> int:
        """The generator's KV cache per token, all layers: keys and values of every KV head, or with
        multi-latent attention the compressed latent and the shared rope key vLLM caches instead
        (DeepSeek-V3: 576 elements per layer where 128 heads would need 2 x 128 x 192)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def load_hf_config(model_dir: str) -> Dict[str, Any]:
    """Reads ``config.json`` of an HF checkpoint dir; clear error when missing."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"policy.model_name: no HF config at {path}")
    with open(path) as f:
        return json.load(f)


def shape_from_hf(cfg: Dict[str, Any]) -> ModelShape:
    """A ``ModelShape`` from an HF config dict of a supported family; refuses (``ValueError`` naming the
    field) what the builder does not map."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    _refuse(cfg, model_type, _common_refusals(cfg, model_type))
    shape = _base_shape(cfg, model_type)
    _FAMILIES.get(model_type, lambda c, s: None)(cfg, shape)
    return shape


def _base_shape(cfg: Dict[str, Any], model_type: str) -> ModelShape:
    rope = _rope(cfg)
    return ModelShape(
        model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "deepseek_v3"),
    )


def _rope(cfg: Dict[str, Any]) -> Dict[str, Any]:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_type(cfg: Dict[str, Any]) -> Optional[str]:
    rope = _rope(cfg)
    return rope.get("rope_type") or rope.get("type")


def _refuse(cfg: Dict[str, Any], model_type: str, unsupported: Dict[str, bool]) -> None:
    """``unsupported``: field description -> whether this config sets it; raises naming every one set."""
    found = [name for name, bad in unsupported.items() if bad]
    if found:
        raise ValueError(f"model_type {model_type!r} with {', '.join(found)} is not supported: the Megatron model "
                         f"would compute something else (see the families table in models/families.py)")


def _common_refusals(cfg: Dict[str, Any], model_type: str) -> Dict[str, bool]:
    """The fields every family refuses unless at their plain value (DeepSeek maps YaRN itself)."""
    rope_type = _rope_type(cfg)
    partial = _rope(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    yarn_ok = model_type == "deepseek_v3" and rope_type == "yarn"
    return {"rope scaling " + repr(rope_type): rope_type not in (None, "default") and not yarn_ok,
            "partial_rotary_factor " + repr(partial): partial not in (None, 1, 1.0),
            "attention_bias": bool(cfg.get("attention_bias")), "mlp_bias": bool(cfg.get("mlp_bias")),
            "hidden_act " + repr(cfg.get("hidden_act")): cfg.get("hidden_act", "silu") != "silu",
            "attention_dropout " + repr(cfg.get("attention_dropout")): bool(cfg.get("attention_dropout"))}


def _qwen3_moe(cfg: Dict[str, Any], shape: ModelShape) -> None:
    _qwen_window(cfg, shape)
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("model_type 'qwen3_moe' with mlp_only_layers / decoder_sparse_step != 1 is not supported")
    shape.num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    shape.moe_topk = cfg["num_experts_per_tok"]
    shape.moe_ffn_hidden_size = cfg["moe_intermediate_size"]
    shape.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))


def _qwen2(cfg: Dict[str, Any], shape: ModelShape) -> None:
    """QKV bias, and Qwen's sliding window."""
    shape.qkv_bias = True
    _qwen_window(cfg, shape)


def _qwen_window(cfg: Dict[str, Any], shape: ModelShape) -> None:
    """Qwen2 / Qwen3: the sliding window only where ``use_sliding_window`` (HF ignores ``sliding_window``
    otherwise), on the layers ``layer_types`` marks (or, without it, from ``max_window_layers`` on)."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else
                                       "full_attention" for i in range(shape.num_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != shape.num_layers:
        raise ValueError(f"model_type 'qwen2': layer_types {types} must name 'sliding_attention' or "
                         f"'full_attention' for each of the {shape.num_layers} layers")
    shape.window_layers = tuple(t == "sliding_attention" for t in types)
    shape.sliding_window = int(cfg["sliding_window"]) if any(shape.window_layers) else 0


def _mistral(cfg: Dict[str, Any], shape: ModelShape) -> None:
    """The sliding window on every layer, where ``sliding_window`` is set (null: full attention)."""
    if cfg.get("layer_types"):
        raise ValueError(f"model_type {shape.model_type!r} with layer_types is not supported (alternating "
                         f"attention is Ministral's; HF's {shape.model_type} class ignores it)")
    shape.sliding_window = int(cfg.get("sliding_window") or 0)


def _mixtral(cfg: Dict[str, Any], shape: ModelShape) -> None:
    """Mistral's attention; MoE with a softmax router over all experts, top-k renormalised (Megatron:
    softmax over the top-k logits, the same numbers); ``intermediate_size`` is the experts' width."""
    _mistral(cfg, shape)
    _refuse(cfg, "mixtral", {"router_jitter_noise " + repr(cfg.get("router_jitter_noise")):
                             bool(cfg.get("router_jitter_noise"))})
    shape.num_experts, shape.moe_topk = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    shape.moe_ffn_hidden_size = shape.ffn_hidden_size
    shape.moe_prefix, shape.expert_proj = "block_sparse_moe", ("w1", "w3", "w2")


def _deepseek_v3(cfg: Dict[str, Any], shape: ModelShape) -> None:
    """MLA, first dense layers, MoE with shared experts and the sigmoid group-limited router; YaRN."""
    heads = shape.num_heads
    _refuse(cfg, "deepseek_v3", {
        "num_key_value_heads != num_attention_heads (MLA has one key per head)":
            cfg.get("num_key_value_heads") not in (None, heads),
        "rope_interleave=false": cfg.get("rope_interleave", True) is False,
        "norm_topk_prob=false (Megatron's sigmoid router renormalises the top-k)":
            not cfg.get("norm_topk_prob", True) and cfg["num_experts_per_tok"] > 1,
        "scoring_func " + repr(cfg.get("scoring_func")): cfg.get("scoring_func", "sigmoid") != "sigmoid",
        "topk_method " + repr(cfg.get("topk_method")): cfg.get("topk_method", "noaux_tc") != "noaux_tc",
        "moe_layer_freq " + repr(cfg.get("moe_layer_freq")): cfg.get("moe_layer_freq", 1) != 1,
    })
    shape.q_lora_rank = int(cfg.get("q_lora_rank") or 0)
    shape.kv_lora_rank = int(cfg["kv_lora_rank"])
    shape.qk_nope_head_dim, shape.qk_rope_head_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    shape.v_head_dim = int(cfg["v_head_dim"])
    shape.head_dim = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    shape.num_experts, shape.moe_topk = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    shape.moe_ffn_hidden_size = int(cfg["moe_intermediate_size"])
    shape.first_dense_layers = min(int(cfg.get("first_k_dense_replace") or 0), shape.num_layers)
    shape.shared_expert_ffn_hidden_size = int(cfg.get("n_shared_experts") or 0) * shape.moe_ffn_hidden_size
    shape.router_score_function, shape.router_expert_bias = "sigmoid", True
    shape.router_scaling_factor = float(cfg.get("routed_scaling_factor") or 1.0)
    _deepseek_groups(cfg, shape)
    if _rope_type(cfg) == "yarn":
        shape.yarn = _deepseek_yarn(cfg)


def _deepseek_groups(cfg: Dict[str, Any], shape: ModelShape) -> None:
    """Group-limited top-k: HF scores a group by the sum of its top-2 experts, Megatron by its top
    ``topk / topk_group``: the same only where that is 2."""
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups <= 1:
        return
    if shape.moe_topk % group_topk or shape.moe_topk // group_topk != 2:
        raise ValueError(f"model_type 'deepseek_v3' with n_group={groups}, topk_group={group_topk} and "
                         f"num_experts_per_tok={shape.moe_topk}: HF scores each group by its top-2 experts, "
                         f"Megatron by its top num_experts_per_tok / topk_group; they agree only when that is 2")
    if shape.num_experts % groups:
        raise ValueError(f"model_type 'deepseek_v3': n_group={groups} does not divide n_routed_experts="
                         f"{shape.num_experts}")
    shape.router_num_groups, shape.router_group_topk = groups, group_topk


def _deepseek_yarn(cfg: Dict[str, Any]) -> Dict[str, float]:
    """DeepSeek's YaRN as Megatron's ``YarnRotaryEmbedding`` computes it: refused where HF's numbers differ
    (an explicit ``attention_factor``, ``truncate=false``, or ``mscale_all_dim`` without ``mscale``: HF's
    cos / sin factor is then 0.1 ln(factor) + 1 while its softmax scale takes ``mscale_all_dim``). HF uses
    ``mscale`` only beside ``mscale_all_dim``; alone it is ignored (Megatron: 1)."""
    rope = _rope(cfg)
    factor = rope.get("factor") or cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
    mscale, mscale_all_dim = float(rope.get("mscale") or 0.0), float(rope.get("mscale_all_dim") or 0.0)
    _refuse(cfg, "deepseek_v3", {
        "rope_parameters.attention_factor": rope.get("attention_factor") is not None,
        "rope_parameters.truncate=false": rope.get("truncate", True) is False,
        "rope_parameters.mscale_all_dim without mscale": bool(mscale_all_dim) and not mscale,
    })
    return dict(factor=float(factor), original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=mscale if mscale_all_dim else 1.0, mscale_all_dim=mscale_all_dim)


_FAMILIES: Dict[str, Callable[[Dict[str, Any], ModelShape], None]] = {
    "qwen3": _qwen_window, "qwen3_moe": _qwen3_moe, "qwen2": _qwen2, "mistral": _mistral, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3,
}
