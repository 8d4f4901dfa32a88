"""Prompt loading and the resumable seeded sampler."""

import json

import pytest

from megatron_grpo.trainer.data import PromptSampler, load_prompts


def test_jsonl_prompts_text_and_ids(tmp_path, tiny_dense):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "the water is hot"}) + "\n\n" + json.dumps({"prompt_token_ids": [3, 4]}) + "\n")
    prompts = load_prompts(str(path), tiny_dense, 0, 1024, 0)
    assert len(prompts) == 2 and prompts[1] == [3, 4] and len(prompts[0]) > 0


@pytest.mark.parametrize("content, match", [
    (b"{bad json", "p.jsonl:1: not JSON"), (b'{"x": 1}', "p.jsonl:1: needs 'prompt'"), (b"", "no prompts"),
    (b'{"prompt_token_ids": [1]}\n{"prompt": "caf\xe9"}', "p.jsonl:2: not UTF-8"),
    (b'{"prompt_token_ids": [1, 2048]}', "p.jsonl:1: token id 2048 is outside the vocabulary"),
    (b'{"prompt_token_ids": [1, -1]}', "p.jsonl:1: token id -1"),
    (b'{"prompt_token_ids": ["1"]}', "p.jsonl:1: 'prompt_token_ids' must be a list of integers"),
    (b'{"prompt_token_ids": [1, 2, 3, 4]}', "p.jsonl:1: prompt of 4 tokens leaves no room.*max_model_len=4"),
    (b"[1, 2]", "p.jsonl:1: needs a JSON object"),
])
def test_bad_prompt_files_name_the_file(tmp_path, content, match):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_prompts(str(path), "/nonexistent", 0, 1024, 0, max_model_len=4)
    with pytest.raises(FileNotFoundError, match="data.prompts_file"):
        load_prompts(str(tmp_path / "missing.jsonl"), "/nonexistent", 0, 1024, 0)


def test_synthetic_prompts_and_resumable_sampler(tiny_dense):
    prompts = load_prompts(None, tiny_dense, 10, 1024, 0)
    assert len(prompts) == 10
    a = PromptSampler(prompts, seed=1)
    first = a.next(7) + a.next(7)
    b = PromptSampler(prompts, seed=1, position=7)
    assert b.next(7) == first[7:]
    assert sorted(map(tuple, first[:10])) == sorted(map(tuple, prompts))  # an epoch covers every prompt once


def test_seeds_do_not_share_epoch_orders():
    """Every (seed, epoch) draws its own order: with ``Random(seed + epoch)`` seed 1's first epoch was seed 0's
    second (two seeds of a study trained on one prompt sequence, shifted by an epoch). Epoch 0 stays the
    stdlib's ``Random(seed).shuffle`` (runs within one epoch are unchanged)."""
    import random

    prompts = [[i] for i in range(32)]
    orders = {}
    for seed in range(4):
        drawn = [p[0] for p in PromptSampler(prompts, seed).next(4 * 32)]
        for epoch in range(4):
            order = drawn[32 * epoch: 32 * (epoch + 1)]
            assert sorted(order) == list(range(32))  # each epoch covers every prompt once
            orders[(seed, epoch)] = tuple(order)
        reference = list(range(32))
        random.Random(seed).shuffle(reference)
        assert list(orders[(seed, 0)]) == reference
    assert len(set(orders.values())) == len(orders), "two (seed, epoch) pairs share a prompt order"
