"""A random-init Qwen3 HF checkpoint written with torch + safetensors alone: no transformers, no tokenizer
(``tools/cluster/gpu_check.py`` runs on a machine without them). Weights as HF initialises them (N(0, 0.02),
norms 1), stored in bf16 as real Qwen3 checkpoints ship. A random model almost never samples EOS, so
``generation_config.json`` lists EOS plus every ``stop_every``-th token id as stop tokens (a length reward
then varies)."""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

STOP_EVERY = 16
"""Every STOP_EVERY-th token id (and EOS) stops a completion."""


def _qwen3_tensors(cfg: Dict, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": ones(hidden)}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        })
    return tensors


def write_random_qwen3(path: str, cfg: Dict, seed: int = 0, stop_every: int = STOP_EVERY) -> str:
    """Writes ``model.safetensors`` (bf16), ``config.json`` (``cfg``, an HF Qwen3 config dict) and
    ``generation_config.json`` (EOS + every ``stop_every``-th id) to ``path``; returns ``path``."""
    from safetensors.torch import save_file

    tensors = _qwen3_tensors(cfg, torch.Generator().manual_seed(seed))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    eos = cfg["eos_token_id"]
    stops = [eos] + [t for t in range(0, cfg["vocab_size"], stop_every) if t != eos]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": stops, "bos_token_id": cfg.get("bos_token_id")}, f)
    return path
