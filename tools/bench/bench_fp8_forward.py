"""Benchmark: the FP8 forward (shadow / probe) dequantizing each linear when it runs vs holding every linear's
fp32 weight for the whole forward (the megatron generator's decode loop), side by side in one run.

Same model, same batch, same bytes (``models.fp8.fp8_forward(..., hold_dequantized=...)``): prints the median
time of one whole-batch log-prob pass in each mode, their ratio, and the fp32 bytes each mode holds beyond the
e4m3 bytes and scales (held: every FP8 linear of the rank; per call: the largest one, while it runs). The log-probs
of both modes must be equal bit for bit (checked).

    python tools/bench/bench_fp8_forward.py [--model DIR] [--rows 16] [--length 96] [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def _timed_pass(model, packed, hold: bool, micro_batch: int, repeats: int):
    from megatron_grpo.models import fp8, unwrap
    from megatron_grpo.models.forward import forward_log_probs

    gpt = unwrap(model)
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        with fp8.fp8_forward(gpt, fp8.recipe_of(gpt), hold_dequantized=hold) as weights:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = forward_log_probs(model, packed, compute_dtype=torch.float8_e4m3fn,
                                        params_dtype=torch.float32, micro_batch_size=micro_batch)
        times.append(time.perf_counter() - start)
    sizes = [w.q.numel() for w in weights.values()]
    return statistics.median(times), out, (sum(sizes) if hold else max(sizes)) * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an HF folder (default: a tiny Qwen3 made here)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=None, help="weight block rows = cols = activation group")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from megatron_grpo.models import build_from_hf, fp8, load_hf_config, shape_from_hf
    from megatron_grpo.models.forward import pack
    from megatron_grpo.models.tiny import make_tiny_model
    from megatron_grpo.parallel import state

    model_dir = args.model or make_tiny_model(tempfile.mkdtemp(prefix="bench-fp8-"), "qwen3")
    shape = shape_from_hf(load_hf_config(model_dir))
    block = args.block or (64 if shape.hidden_size % 128 else 128) if args.model else 32
    state.initialize_model_parallel(state.Layout(world_size=1))
    recipe = fp8.Fp8Recipe(weight_block_size=(block, block), activation_block_size=block)
    model = build_from_hf(model_dir, fp8_recipe=recipe)[0]
    gen = torch.Generator().manual_seed(0)
    packed = pack([torch.randint(5, shape.vocab_size, (args.length,), generator=gen).tolist()
                   for _ in range(args.rows)], [args.length // 4] * args.rows)
    results = {}
    with torch.no_grad():
        for hold in (False, True, False, True):  # alternated: a busy machine slows both alike
            seconds, out, fp32_bytes = _timed_pass(model, packed, hold, args.micro_batch, args.repeats)
            results.setdefault(hold, []).append(seconds)
            results[(hold, "out")], results[(hold, "bytes")] = out, fp32_bytes
    assert torch.equal(results[(False, "out")], results[(True, "out")]), "per-call and held FP8 forwards differ"
    per_call, held = min(results[False]), min(results[True])
    print(f"model {model_dir}: {args.rows} rows x {args.length} tokens, micro-batch {args.micro_batch}, "
          f"blocks {block}")
    print(f"  per-call dequantization: {per_call:.3f} s, fp32 held {results[(False, 'bytes')] / 2**20:.1f} MiB")
    print(f"  held for the forward:    {held:.3f} s, fp32 held {results[(True, 'bytes')] / 2**20:.1f} MiB")
    print(f"  time per-call / held: {per_call / held:.3f}; fp32 bytes held / per-call: "
          f"{results[(True, 'bytes')] / results[(False, 'bytes')]:.1f}; log-probs equal bit for bit")


if __name__ == "__main__":
    main()
