"""tools/study/pretrain.py (issue 16 item 1) on a micro corpus: determinism, learning, a loadable export, the card."""

import json
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "study"))

MICRO = ["--val-every", "3", "--vocab-size", "320", "--layers", "2", "--hidden", "64", "--heads", "4",
         "--kv-heads", "2", "--head-dim", "16", "--ffn", "128", "--steps", "20", "--batch-size", "8",
         "--seq-len", "32", "--lr", "3e-3", "--num-samples", "2", "--prompt-len", "8", "--gen-len", "8",
         "--log-every", "0", "--seed", "3"]


def _write_micro_corpus(root):
    rng = random.Random(0)
    words = "def return import class self value list dict for in range if else the cat sat on a mat".split()
    os.makedirs(root)
    for i in range(6):
        lines = (" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) for _ in range(150))
        with open(os.path.join(root, f"f{i}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs with the same seed, each training its own tokenizer (separate caches)."""
    import pretrain

    tmp = tmp_path_factory.mktemp("pretrain")
    corpus = _write_micro_corpus(str(tmp / "corpus"))
    return [pretrain.main(["--out", str(tmp / f"out{i}"), "--corpus-dir", corpus,
                           "--cache-dir", str(tmp / f"cache{i}"), *MICRO]) for i in range(2)]


def test_same_seed_gives_identical_weights_and_tokenizer(runs):
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(card["out"], "model.safetensors")) for card in runs)
    assert sorted(a) == sorted(b) and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    init = load_file(os.path.join(runs[0]["out"], "init", "model.safetensors"))
    assert not torch.equal(init["model.embed_tokens.weight"], a["model.embed_tokens.weight"])  # it did train
    tok_a, tok_b = (open(card["tokenizer"]["path"], "rb").read() for card in runs)
    assert runs[0]["tokenizer"]["path"] != runs[1]["tokenizer"]["path"] and tok_a == tok_b
    exported = [open(os.path.join(card["out"], "tokenizer.json"), "rb").read() for card in runs]
    assert exported[0] == exported[1]
    from tokenizers import Tokenizer

    assert Tokenizer.from_str(exported[0].decode()).get_vocab() == Tokenizer.from_str(tok_a.decode()).get_vocab()


def test_validation_loss_falls(runs):
    val = runs[0]["validation"]
    assert val["loss"] < val["loss_init"] - 0.5
    assert val["perplexity"] < val["perplexity_init"]


def test_export_loads_in_transformers_and_megatron_with_equal_logits(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_grpo.models import build_from_hf, forward_logits

    out = runs[0]["out"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("def value(self): return the list", add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] >= 4 and tokenizer.eos_token_id == 0
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    model, _ = build_from_hf(out)  # the parallel state is the one pretrain.main set up
    model.eval()
    with torch.no_grad():
        ref, got = hf(ids).logits, forward_logits(model, ids).float()
    assert ref.shape == got.shape
    assert torch.allclose(ref, got, atol=1e-4, rtol=0), (ref - got).abs().max().item()


def test_model_card_has_the_fields(runs):
    card = runs[0]
    with open(os.path.join(card["out"], "MODEL_CARD.json")) as f:
        on_disk = json.load(f)
    assert on_disk["training"]["tokens_seen"] == 20 * 8 * 32 and on_disk["training"]["steps"] == 20
    corpus = on_disk["corpus"]
    assert corpus["files"] == 6 and corpus["files_val"] == 2 and corpus["bytes"] > 0 and corpus["tokens_train"] > 0
    assert os.path.isabs(corpus["path"]) and corpus["tokens_val"] > 0
    for key in ("loss", "loss_init", "perplexity", "perplexity_init", "tokens"):
        assert on_disk["validation"][key] > 0
    rarity = on_disk["rarity"]
    assert rarity["tokens"] == 2 * 8 and 0 <= rarity["share_lt_minus20"] <= rarity["share_lt_minus5"] <= 1
    assert on_disk["wall_time_s"] > 0 and on_disk["training"]["steps_per_s"] > 0
    assert on_disk["model"]["num_hidden_layers"] == 2 and on_disk["model"]["params"] > 0
    with open(os.path.join(card["out"], "MODEL_CARD.md")) as f:
        text = f.read()
    assert "perplexity" in text and "log-prob < -5" in text and "tokens seen" in text


def test_default_corpus_is_the_stdlib_split_by_file(tmp_path):
    import pretrain

    corpus = pretrain.load_corpus(None, None, 0.5, 50)
    meta = corpus["meta"]
    assert meta["ext"] == ".py" and meta["bytes"] <= 0.5 * 2 ** 20 and meta["files_val"] >= 1
    assert meta["files_train"] + meta["files_val"] == meta["files"]
    assert pretrain.load_corpus(None, None, 0.5, 50)["meta"]["sha256"] == meta["sha256"]  # deterministic
