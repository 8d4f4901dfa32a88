"""tools/study/beta_real.py (issue 34 item 3): the per-pair statistics, rarity buckets and the table with the
write-up's row, on synthetic log-probs (the real run needs SmolLM2 and vLLM: docs/results/beta-scaling.md)."""

import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "study"))

import beta_real  # noqa: E402


def test_beta_row_buckets_on_the_generator_log_prob_and_counts_beyond_eps():
    rarity = torch.tensor([-1.0, -2.0, -7.0, -15.0, -25.0, -30.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -2.0, -7.0, -15.0, -25.0, -30.0], dtype=torch.float64)
    other = ref - torch.tensor([0.01, -0.03, 0.1, 0.3, -1.0, 0.5], dtype=torch.float64)
    row = beta_real.beta_row("p", ref, other, rarity)
    assert row["tokens"] == 6 and row["beyond_eps"] == pytest.approx(3 / 6)
    assert row["beta_abs_max"] == pytest.approx(1.0) and row["beta_mean"] == pytest.approx((0.01 - 0.03 + 0.1 + 0.3 - 1 + 0.5) / 6)
    assert (row["n_gt-5"], row["n_-10..-5"], row["n_-20..-10"], row["n_le-20"]) == (2, 1, 1, 2)
    assert row["beta_abs_gt-5"] == pytest.approx(0.02) and row["beta_abs_le-20"] == pytest.approx(0.75)
    empty = beta_real.beta_row("q", ref[:2], other[:2], rarity[:2])
    assert math.isnan(empty["beta_abs_le-20"]) and empty["n_le-20"] == 0
    page = beta_real.markdown([row, empty], "cmd", "meta")
    assert "| p | 6 | " in page and "Qwen3-0.6B: fp32 trainer vs bf16 vLLM (write-up) | n/a | 0.076 | 0.149 | 3.05" in page
    assert "0.75 (2)" in page and "n/a (0)" in page


def test_every_pair_names_a_scoring_pass_or_the_generator():
    names = {name for name, _, _ in beta_real.SCORES} | {"vllm-bf16"}
    assert all(ref in names and other in names for _, ref, other in beta_real.PAIRS)
    assert [b[0] for b in beta_real.BUCKETS] == ["gt-5", "-10..-5", "-20..-10", "le-20"]


def test_every_fp8_pair_names_an_fp8_pass_or_the_fp8_generator():
    names = {name for name, _, _ in beta_real.FP8_SCORES} | {"fp8-generator"}
    assert all(ref in names and other in names for _, ref, other in beta_real.FP8_PAIRS)
    assert set(beta_real.FP8_VARIANTS) <= names


def test_fp8_generator_mode_end_to_end_on_the_tiny_llama(tiny_llama, tmp_path, megatron_single):
    """``--generator megatron-fp8`` on the SmolLM2-shaped tiny Llama (blocks 32): the fp8 generator's reported
    log-probs are its fp8 shadow's exactly; the FP8 gap is several times the bf16 one; the variants differ."""
    import json
    import shutil

    model = str(tmp_path / "llama")
    shutil.copytree(tiny_llama, model)
    with open(os.path.join(model, "eos_prompts.jsonl"), "w") as f:
        for ids in ([5, 6, 7, 8], [9, 10, 11, 12, 13]):
            f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
    out = beta_real.main(["--model", model, "--out", str(tmp_path / "out"), "--generator", "megatron-fp8",
                          "--fp8-block", "32", "--prompts", "2", "--samples", "2", "--max-new-tokens", "6"])
    rows = {r["pair"]: r for r in out["rows"]}
    assert len(rows) == len(beta_real.FP8_PAIRS)
    assert rows["fp8 generator's reported log-probs vs the fp8 shadow"]["beta_abs_max"] == 0.0
    bf16 = rows["fp32 trainer vs bf16 autocast (the bf16 gap)"]["beta_abs_mean"]
    assert rows["fp32 trainer vs fp8 generator"]["beta_abs_mean"] > 3 * bf16 > 0
    variants = {rows[f"fp32 trainer vs fp8{v}"]["beta_abs_mean"] for v in (" generator", ", pow2 scales",
                                                                         ", first / last 2 layers bf16")}
    assert len(variants) == 3
    with open(tmp_path / "out" / "beta_real.md") as f:
        assert "sampled by megatron-fp8 fp8, blocks 32" in f.read()
