"""Benchmark: computed / useful tokens and step time, padded vs packed vs token-budget, in one run.

One batch with a long-tailed completion-length mix (lognormal, clipped at ``--max-ratio`` x the
median; tiny Qwen3 unless --model), trained by the same fp32 step three ways:

- padded: ``policy.train_micro_batch_size`` rows per micro-batch, every row the batch's longest;
- packed: ``policy.sequence_packing.enabled`` (rows of ``train_mb_tokens``, one per micro-batch);
- token-budget: ``policy.dynamic_batching.enabled`` (``max_tokens_per_microbatch``, padded rows).

Useful tokens: the sequences' own (prompt + completion) tokens. Computed tokens: every position
the model runs, padding included (from the step's micro-batch plan). Prints one line per mode and
the ratios last (acceptance: packed <= 1.2x useful).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def lengths(rows: int, median: int, max_ratio: float, sigma: float, seed: int = 0):
    """Lognormal completion lengths with the given median, clipped to [1, max_ratio x median];
    the longest is set to the cap (the tail a reasoning batch has)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(rows, generator=gen) * sigma) * median
    out = raw.clamp(1, max_ratio * median).round().long().tolist()
    out[int(torch.argmax(torch.tensor(out)))] = int(max_ratio * median)
    return out


def make_batch(vocab_size: int, prompt_len: int, completion_lengths, seed: int = 0):
    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.trainer.step import build_step_batch

    gen = torch.Generator().manual_seed(seed)
    items = []
    for i, n in enumerate(completion_lengths):
        prompt = torch.randint(5, vocab_size, (prompt_len,), generator=gen).tolist()
        completion = torch.randint(5, vocab_size, (n,), generator=gen).tolist()
        items.append(Rollout(i // 8, prompt, completion, [-7.0] * n, "length", 0))
    adv = torch.randn(len(items), generator=gen)
    return build_step_batch(Rollouts(items), adv, 0, 1, pad_id=0)


def run_mode(model_dir, policy: dict, batch, repeats: int):
    """(computed tokens, median step seconds) of one mode."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.config.schema import Config, from_dict
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.models.packing import computed_tokens
    from megatron_grpo.trainer.optim import Optimizer, wrap_model
    from megatron_grpo.trainer.step import TrainStep

    cfg = from_dict(Config, {"policy": {"model_name": model_dir, **policy}, "grpo": {"deployed_improvement": False}})
    torch.manual_seed(0)
    model = wrap_model(build_from_hf(model_dir)[0], cfg)
    step = TrainStep(model, Optimizer(model, cfg), cfg, ps.get_tensor_model_parallel_group(),
                     ps.get_data_parallel_group())
    computed = computed_tokens(step.make_plan(batch.packed, equalise=False))
    step.run(batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step.run(batch)
        times.append(time.perf_counter() - start)
    return computed, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--median", type=int, default=48, help="median completion length")
    parser.add_argument("--max-ratio", type=float, default=8.0, help="longest completion / median")
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of the lengths")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="padded mode's rows per micro-batch")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="token budget (packed row / token-budget micro-batch); 0 = the longest sequence, x2 "
                             "for the token budget")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from megatron_grpo.models import load_hf_config, shape_from_hf
    from megatron_grpo.parallel import state

    model_dir = args.model
    if model_dir is None:
        from megatron_grpo.models.tiny import make_tiny_model

        model_dir = make_tiny_model(tempfile.mkdtemp(prefix="bench-packing-"), "qwen3")
    state.initialize_model_parallel(state.Layout(world_size=1))
    shape = shape_from_hf(load_hf_config(model_dir))
    completion = lengths(args.rows, args.median, args.max_ratio, args.sigma)
    batch = make_batch(shape.vocab_size, args.prompt_len, completion)
    useful = sum(args.prompt_len + n for n in completion)
    longest = args.prompt_len + max(completion)
    row_tokens = args.max_tokens or longest
    modes = {
        "padded": {"train_micro_batch_size": args.micro_batch_size},
        "packed": {"sequence_packing": {"enabled": True, "train_mb_tokens": row_tokens}},
        "token-budget": {"dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": args.max_tokens or 2 * longest}},
    }
    print(f"rows {args.rows}, prompt {args.prompt_len}, completion median {statistics.median(completion):.0f} "
          f"max {max(completion)} (lognormal sigma {args.sigma}), useful tokens {useful}")
    results = {}
    for name, policy in modes.items():
        computed, seconds = run_mode(model_dir, policy, batch, args.repeats)
        results[name] = (computed, seconds)
        print(f"{name:>13}: computed {computed:7d} tokens = {computed / useful:5.2f}x useful, step {seconds:6.3f} s")
    pad_c, pad_s = results["padded"]
    for name in ("packed", "token-budget"):
        c, s = results[name]
        print(f"{name} / padded: computed {c / pad_c:.3f}x, step time {s / pad_s:.3f}x")
    print(f"computed / useful: padded {pad_c / useful:.2f}x, packed {results['packed'][0] / useful:.2f}x "
          f"(acceptance <= 1.2x), token-budget {results['token-budget'][0] / useful:.2f}x")


if __name__ == "__main__":
    main()
