"""Prompts: a JSONL file or a built-in synthetic set, served in a seeded order."""

from __future__ import annotations

import json
import os
import random
from typing import List, Optional, Tuple

_SYNTHETIC = ["Tell me about", "Write one word:", "The answer is", "Say something short.", "Once upon a time",
              "Q: what is two plus two? A:", "Finish the sentence: the sky is", "List three colours:"]


def load_prompts(prompts_file: Optional[str], tokenizer_dir: str, num_synthetic: int, vocab_size: int,
                 seed: int, max_model_len: Optional[int] = None) -> List[List[int]]:
    """Prompt token-id lists from ``prompts_file`` (JSONL) or a synthetic set.

    File prompts are validated here, at load time, naming file and line: UTF-8, JSON, token ids
    inside the vocabulary, and shorter than ``generation.max_model_len`` (room for one token),
    so that a bad prompt never reaches the generator (where it cost restarts and an opaque
    error)."""
    if prompts_file:
        return _from_jsonl(prompts_file, tokenizer_dir, vocab_size, max_model_len)
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model dir with none of these is token-id only."""


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None for token-id-only models (no tokenizer files: transformers
    5 would build an *empty* tokenizer from config.json's model_type, encoding every prompt to [])."""
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 - models without a tokenizer use token-id prompts
        return None


def _from_jsonl(path: str, tokenizer_dir: str, vocab_size: int, max_model_len: Optional[int]) -> List[List[int]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.prompts_file: no such file {path}")
    tokenizer, prompts = None, []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"data.prompts_file {path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not UTF-8 ({exc})") from exc
            if not line.strip():
                continue
            ids, tokenizer = _prompt_ids(line, where, tokenizer, tokenizer_dir)
            _check_prompt(ids, where, vocab_size, max_model_len)
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"data.prompts_file {path} has no prompts")
    return prompts


def _prompt_ids(line: str, where: str, tokenizer, tokenizer_dir: str):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(row, dict):
        raise ValueError(f"{where}: needs a JSON object with 'prompt' or 'prompt_token_ids'")
    if "prompt_token_ids" in row:
        ids = row["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a list of integers")
        return list(ids), tokenizer
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        tokenizer = tokenizer or load_tokenizer(tokenizer_dir)
        if tokenizer is None:
            raise ValueError(f"{where}: text prompt but the model has no tokenizer")
        return tokenizer(row["prompt"], add_special_tokens=False)["input_ids"], tokenizer
    raise ValueError(f"{where}: needs 'prompt' or 'prompt_token_ids'")


def _check_prompt(ids: List[int], where: str, vocab_size: int, max_model_len: Optional[int]) -> None:
    if not ids:
        raise ValueError(f"{where}: empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise ValueError(f"{where}: prompt of {len(ids)} tokens leaves no room to generate within "
                         f"generation.max_model_len={max_model_len}")


def epoch_order(num_prompts: int, seed: int, epoch: int) -> List[int]:
    """The prompt order of one epoch: a shuffle seeded by (seed, epoch). Epoch 0 keeps ``Random(seed)``
    (runs within one epoch draw what they always drew); later epochs seed with the string ``"seed:epoch"``,
    so that no two (seed, epoch) pairs share an order (``Random(seed + epoch)`` gave seed s+1 seed s's
    orders one epoch earlier: the seeds of a study drew the same prompt sequence, shifted by an epoch)."""
    order = list(range(num_prompts))
    random.Random(seed if epoch == 0 else f"{seed}:{epoch}").shuffle(order)
    return order


class PromptSampler:
    """Serves prompts epoch by epoch in a seeded shuffled order (``epoch_order``); ``position`` makes it
    resumable."""

    def __init__(self, prompts: List[List[int]], seed: int, position: int = 0):
        self.prompts, self.seed, self.position = prompts, seed, position
        self._order: Tuple[int, List[int]] = (-1, [])
        """(epoch, its order): shuffled once per epoch, not once per prompt drawn."""

    def next(self, count: int) -> List[List[int]]:
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.prompts))
            if self._order[0] != epoch:
                self._order = (epoch, epoch_order(len(self.prompts), self.seed, epoch))
            out.append(self.prompts[self._order[1][index]])
            self.position += 1
        return out
