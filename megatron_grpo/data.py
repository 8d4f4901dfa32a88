"""Prompts: a JSONL file or a built-in synthetic set, served in a seeded order."""

from __future__ import annotations

import json
import os
import random
from typing import List, Optional

_SYNTHETIC = ["Tell me about", "Write one word:", "The answer is", "Say something short.", "Once upon a time",
              "Q: what is two plus two? A:", "Finish the sentence: the sky is", "List three colours:"]


def load_prompts(prompts_file: Optional[str], tokenizer_dir: str, num_synthetic: int, vocab_size: int,
                 seed: int) -> List[List[int]]:
    """Prompt token-id lists from ``prompts_file`` (JSONL) or a synthetic set."""
    if prompts_file:
        return _from_jsonl(prompts_file, tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    rng = random.Random(seed)
    prompts = []
    for i in range(num_synthetic):
        text = f"{_SYNTHETIC[i % len(_SYNTHETIC)]} {rng.randint(0, 999)}"
        if tokenizer is not None:
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            prompts.append([rng.randrange(vocab_size) for _ in range(8)])
    return prompts


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None for token-id-only models."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 - models without a tokenizer use token-id prompts
        return None


def _from_jsonl(path: str, tokenizer_dir: str) -> List[List[int]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.prompts_file: no such file {path}")
    tokenizer, prompts = None, []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"data.prompts_file {path}:{lineno}: not JSON ({exc})") from exc
            if "prompt_token_ids" in row:
                prompts.append([int(t) for t in row["prompt_token_ids"]])
            elif "prompt" in row:
                tokenizer = tokenizer or load_tokenizer(tokenizer_dir)
                if tokenizer is None:
                    raise ValueError(f"data.prompts_file {path}:{lineno}: text prompt but the model has no tokenizer")
                prompts.append(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
            else:
                raise ValueError(f"data.prompts_file {path}:{lineno}: needs 'prompt' or 'prompt_token_ids'")
    if not prompts:
        raise ValueError(f"data.prompts_file {path} has no prompts")
    return prompts


class PromptSampler:
    """Serves prompts epoch by epoch in a seeded shuffled order; ``position`` makes it resumable."""

    def __init__(self, prompts: List[List[int]], seed: int, position: int = 0):
        self.prompts, self.seed, self.position = prompts, seed, position

    def next(self, count: int) -> List[List[int]]:
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.prompts))
            order = list(range(len(self.prompts)))
            random.Random(self.seed + epoch).shuffle(order)
            out.append(self.prompts[order[index]])
            self.position += 1
        return out
