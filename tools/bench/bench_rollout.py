"""Benchmark the generator, side by side in one run:

1. tokens/s of 1 vs 2 vLLM engines (``EnginePool``; each of the 2 engines bound to half the
   cores) and of ``transformers.generate`` (goal: vLLM >= 3x transformers);
2. seconds to push the model's weights (bucketed at layer ends, like training) to 1 vs 2 engines
   (one fan-out push: each bucket written once under /dev/shm, read by every engine) vs a raw
   memcpy of the same bytes (goal: 2 engines <= 1.3x 1 engine).

Same prompts, completions and tokens for every generator, sampling at temperature 1.
Usage: python tools/bench/bench_rollout.py [--model DIR | --hidden 1024 --layers 8] [--prompts 8] [--n 8]
       [--max-tokens 64] [--bucket-mb 64] [--repeats 3] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def start_pool(model_dir, num_engines, dtype):
    from megatron_grpo.rollout.pool import EnginePool, available_cpus, cpu_bindings
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine

    binds = cpu_bindings(num_engines, 1, available_cpus())
    return EnginePool(lambda i: VLLMEngine(model_dir, dtype, max_model_len=256, cpu_bind=binds[i]), num_engines)


def bench_engines(model_dir, prompts, n, max_tokens, dtype, num_engines, buckets, repeats):
    """Tokens/s, median push seconds and start seconds of a pool of ``num_engines``; with 2 engines
    also of engine 0 alone (same pinned cores: the like-for-like reference of the pair)."""
    from megatron_grpo.rollout import Sampling
    from megatron_grpo.rollout.transfer.fanout import fan_out

    started = time.perf_counter()
    pool = start_pool(model_dir, num_engines, dtype)
    start_s = time.perf_counter() - started
    sampling = Sampling(max_tokens=max_tokens, seed=1, stop_token_ids=())
    out = {"start_s": start_s}
    try:
        pool.generate(prompts[:num_engines], 1, Sampling(max_tokens=4, seed=0))  # warm-up, every engine
        out["tokens_per_s"] = _tokens_per_s(lambda: pool.generate(prompts, n, sampling))
        out["push_s"] = _median_push(lambda v: pool.update_weights(buckets, v), repeats)
        if num_engines > 1:
            out["alone_tokens_per_s"] = _tokens_per_s(lambda: pool.engines[0].generate(prompts, n, sampling))
            out["alone_push_s"] = _median_push(lambda v: fan_out(buckets, pool.engines[:1], 100 + v), repeats)
    finally:
        pool.close()
    return out


def _tokens_per_s(generate) -> float:
    started = time.perf_counter()
    rollouts = generate()
    return sum(len(r.completion_ids) for r in rollouts) / (time.perf_counter() - started)


def _median_push(push, repeats) -> float:
    seconds = []
    for version in range(1, repeats + 2):  # the first push warms up
        started = time.perf_counter()
        push(version)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def bench_memcpy(buckets, repeats):
    """Median seconds to copy every pushed tensor once into preallocated host memory."""
    targets = [[torch.empty_like(t) for _, t in bucket] for bucket in buckets]
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for bucket, dsts in zip(buckets, targets):
            for (_, src), dst in zip(bucket, dsts):
                dst.copy_(src)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def weight_buckets(model_dir, dtype, bucket_mb):
    """The checkpoint's tensors, nudged (so a push changes something) and cast, grouped into buckets of
    about ``bucket_mb`` that close only between layers (as ``weight_sync.hf_buckets`` does)."""
    from safetensors.torch import load_file

    from megatron_grpo.rollout.transfer.weight_sync import _layer_of

    buckets, bucket, size, group = [], [], 0, None
    for name, tensor in load_file(os.path.join(model_dir, "model.safetensors")).items():
        if size >= bucket_mb * 2**20 and _layer_of(name) != group:
            buckets.append(bucket)
            bucket, size = [], 0
        group = _layer_of(name)
        bucket.append((name, (tensor * 1.01).to(dtype).contiguous()))
        size += tensor.numel() * bucket[-1][1].element_size()
    return buckets + [bucket] if bucket else buckets


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
    parser.add_argument("--hidden", type=int, default=None, help="without --model: a wider tiny Qwen3 (e.g. 1024)")
    parser.add_argument("--layers", type=int, default=None, help="without --model: this many layers")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3, help="pushes timed per engine count (median)")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    from megatron_grpo.models.tiny import make_sized_model

    model_dir = args.model or make_sized_model(args.hidden, args.layers, prefix="bench-rollout-")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(args.prompts)]
    buckets = weight_buckets(model_dir, dtype, args.bucket_mb)
    num_bytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    results = {k: bench_engines(model_dir, prompts, args.n, args.max_tokens, dtype, k, buckets, args.repeats)
               for k in (1, 2)}
    memcpy_s = bench_memcpy(buckets, args.repeats)
    hf_tps = None if args.skip_transformers else bench_transformers(model_dir, prompts, args.n, args.max_tokens, dtype)
    one, two = results[1], results[2]
    print(f"model={model_dir} ({num_bytes / 2**20:.1f} MiB in {args.dtype}) prompts={args.prompts} n={args.n} "
          f"max_tokens={args.max_tokens} cpus={len(os.sched_getaffinity(0))}")
    print("columns: 1 engine (vLLM's own threads, all cores) | 2 engines (each pinned to half the cores) | "
          "engine 0 of the pair alone")
    print(f"engine start (s):    {one['start_s']:8.1f} | {two['start_s']:8.1f} (concurrently) |")
    print(f"generation tokens/s: {one['tokens_per_s']:8.1f} | {two['tokens_per_s']:8.1f} | "
          f"{two['alone_tokens_per_s']:8.1f}")
    if hf_tps is not None:
        print(f"transformers.generate: {hf_tps:8.1f} tokens/s; vLLM (1 engine) / transformers: "
              f"{one['tokens_per_s'] / hf_tps:.2f}x (goal >= 3x)")
    print(f"weight push (s, {len(buckets)} bucket(s), median of {args.repeats}): {one['push_s']:8.3f} | "
          f"{two['push_s']:8.3f} | {two['alone_push_s']:8.3f}    raw memcpy of the same bytes: {memcpy_s:.4f} s")
    print(f"push to 2 engines / push to 1: {two['push_s'] / one['push_s']:.2f}x vs the 1-engine run, "
          f"{two['push_s'] / two['alone_push_s']:.2f}x vs engine 0 alone (goal <= 1.3x)")


if __name__ == "__main__":
    main()
