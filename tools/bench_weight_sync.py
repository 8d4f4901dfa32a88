"""Benchmark: Megatron -> vLLM weight push vs a plain in-memory copy of the same bytes.

The push gathers shards, maps names, casts to the generator dtype and streams buckets
into vLLM (``push_weights``); the baseline clones the same HF-named tensors in memory.
Side by side in one run; prints the ratio last (goal <= 3x).
Usage: python tools/bench_weight_sync.py [--model DIR] [--dtype float32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a fresh tiny Qwen3)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from megatron_grpo.models import build_from_hf
    from megatron_grpo.models.weights import export_hf_tensors
    from megatron_grpo.parallel import state
    from megatron_grpo.rollout.vllm_engine import VLLMEngine
    from megatron_grpo.rollout.weight_sync import push_weights

    model_dir = args.model
    if model_dir is None:
        from megatron_grpo.models.tiny import make_tiny_model

        model_dir = make_tiny_model(tempfile.mkdtemp(prefix="bench-sync-"), "qwen3")
    dtype = getattr(torch, args.dtype)
    state.initialize_model_parallel(state.Layout(world_size=1))
    model, shape = build_from_hf(model_dir)
    engine = VLLMEngine(model_dir, dtype, max_model_len=128, is_moe=shape.is_moe)
    try:
        push_times, copy_times, nbytes = [], [], 0
        for version in range(1, args.repeats + 1):
            start = time.perf_counter()
            report = push_weights(model, shape, engine, version, dtype=dtype, bucket_mb=args.bucket_mb)
            push_times.append(time.perf_counter() - start)
            nbytes = report.num_bytes
            tensors = [t.to(dtype) for _, t in export_hf_tensors(model, shape)]
            start = time.perf_counter()
            copies = [t.clone() for t in tensors]
            copy_times.append(time.perf_counter() - start)
            del copies, tensors
    finally:
        engine.close()
    push, copy = statistics.median(push_times), statistics.median(copy_times)
    print(f"model={model_dir} dtype={args.dtype} bytes={nbytes / 2**20:.1f} MiB bucket={args.bucket_mb} MiB "
          f"(median of {args.repeats})")
    print(f"push into vLLM:     {push * 1e3:9.2f} ms")
    print(f"plain memory copy:  {copy * 1e3:9.2f} ms")
    print(f"ratio push / copy: {push / copy:.1f}x  (goal <= 3x)")


if __name__ == "__main__":
    main()
