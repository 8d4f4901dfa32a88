"""Benchmark: train-step time with and without the shadow forward, side by side in one run.

Three configurations of the same step on the same batch (tiny Qwen3 unless --model):
fp32 trainer with a bf16 shadow (precisions differ: shadow runs), fp32 trainer with an
fp32 shadow (matched: the shadow is skipped), and bf16 autocast with a bf16 shadow
(matched). Prints the overhead ratios last (goal: <= 40% when they differ, 0 when matched).
Note: bf16 is emulated on CPUs without native bf16, which inflates the shadow's cost here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def _batch(shape, rows, prompt_len, completion_len, seed=0):
    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.trainer.step import build_step_batch

    gen = torch.Generator().manual_seed(seed)
    items = []
    for i in range(rows):
        prompt = torch.randint(5, shape.vocab_size, (prompt_len,), generator=gen).tolist()
        completion = torch.randint(5, shape.vocab_size, (completion_len,), generator=gen).tolist()
        items.append(Rollout(i // 8, prompt, completion, [-7.0] * completion_len, "length", 0))
    adv = torch.randn(rows, generator=gen)
    return build_step_batch(Rollouts(items), adv, 0, 1, pad_id=0)


def time_step(model_dir, compute, shadow, batch, repeats) -> float:
    from megatron.core import parallel_state as ps

    from megatron_grpo.config.schema import Config, from_dict
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.trainer.optim import Optimizer, wrap_model
    from megatron_grpo.trainer.step import TrainStep

    cfg = from_dict(Config, {"policy": {"precision": {"compute_dtype": compute, "generation_dtype": shadow,
                                                      "shadow_dtype": shadow}},
                             "grpo": {"deployed_improvement": False}})
    torch.manual_seed(0)
    model = wrap_model(build_from_hf(model_dir)[0], cfg)
    step = TrainStep(model, Optimizer(model, cfg), cfg, ps.get_tensor_model_parallel_group(),
                     ps.get_data_parallel_group())
    step.run(batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step.run(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from megatron_grpo.models import load_hf_config, shape_from_hf
    from megatron_grpo.parallel import state

    model_dir = args.model
    if model_dir is None:
        from megatron_grpo.models.tiny import make_tiny_model

        model_dir = make_tiny_model(tempfile.mkdtemp(prefix="bench-shadow-"), "qwen3")
    state.initialize_model_parallel(state.Layout(world_size=1))
    shape = shape_from_hf(load_hf_config(model_dir))
    batch = _batch(shape, args.rows, args.prompt_len, args.completion_len)
    no_shadow = time_step(model_dir, "float32", "float32", batch, args.repeats)
    with_shadow = time_step(model_dir, "float32", "bfloat16", batch, args.repeats)
    bf16 = time_step(model_dir, "bfloat16", "bfloat16", batch, args.repeats)
    print(f"model={model_dir} rows={args.rows} tokens/row={args.prompt_len + args.completion_len}")
    print(f"fp32 step, shadow skipped (matched):    {no_shadow * 1e3:8.1f} ms")
    print(f"fp32 step + bf16 shadow (mismatched):   {with_shadow * 1e3:8.1f} ms")
    print(f"bf16 autocast step, shadow skipped:     {bf16 * 1e3:8.1f} ms")
    print(f"shadow overhead when precisions differ: {with_shadow / no_shadow - 1:.1%}  (goal <= 40%)")
    print("shadow overhead when they match: 0% (the shadow forward is skipped; beta reported as exactly 0)")


if __name__ == "__main__":
    main()
