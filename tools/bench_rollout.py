"""Benchmark: vLLM (our generator process) tokens/s vs ``transformers.generate`` on the same model.

Same prompts, same number of completions and tokens, sampling at temperature 1, side by
side in one run. Prints the ratio last (goal >= 3x).
Usage: python tools/bench_rollout.py [--model DIR] [--prompts 8] [--n 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def bench_vllm(model_dir, prompts, n, max_tokens, dtype):
    from megatron_grpo.rollout import Sampling
    from megatron_grpo.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, dtype, max_model_len=256)
    try:
        engine.generate(prompts[:1], 1, Sampling(max_tokens=4, seed=0))  # warm-up
        start = time.perf_counter()
        rollouts = engine.generate(prompts, n, Sampling(max_tokens=max_tokens, seed=1, stop_token_ids=()))
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return sum(len(r.completion_ids) for r in rollouts) / seconds


def bench_transformers(model_dir, prompts, n, max_tokens, dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                  num_return_sequences=n, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], **dict(kwargs, max_new_tokens=4, min_new_tokens=4,
                                                               num_return_sequences=1))
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        seconds = time.perf_counter() - start
    return (out.shape[1] - width) * out.shape[0] / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a fresh tiny Qwen3)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from megatron_grpo.models.tiny import make_tiny_model

        model_dir = make_tiny_model(tempfile.mkdtemp(prefix="bench-rollout-"), "qwen3")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(args.prompts)]
    vllm_tps = bench_vllm(model_dir, prompts, args.n, args.max_tokens, dtype)
    hf_tps = bench_transformers(model_dir, prompts, args.n, args.max_tokens, dtype)
    print(f"model={model_dir} prompts={args.prompts} n={args.n} max_tokens={args.max_tokens} dtype={args.dtype}")
    print(f"vLLM:         {vllm_tps:8.1f} tokens/s")
    print(f"transformers: {hf_tps:8.1f} tokens/s")
    print(f"ratio vLLM / transformers: {vllm_tps / hf_tps:.2f}x  (goal >= 3x)")


if __name__ == "__main__":
    main()
