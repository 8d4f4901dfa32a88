"""Benchmark: the train phase alone, ours vs transformers', side by side in one process (issue 33 item 5).

The same Qwen3 weights (default ~26M params: hidden 512, 8 layers, vocab 1024; ``models/tiny.py``), the same
batch (``--rows`` sequences of ``--seq`` tokens, micro-batches of ``--micro-batch-size``), one thread:

- ``ours``: ``TrainStep.forward_backward`` (Megatron-Core's schedule, DDP, our loss) + ``Optimizer.step``
  (Megatron-Core's optimizer: grad norm, clip, torch's fused AdamW on CPU);
- ``ours-unfused``: the same without ``parallel.cpu.fuse_wgrad_accumulation`` (each weight gradient a new
  tensor that DDP's hook adds to ``main_grad``: Megatron-Core's path without Apex);
- ``transformers``: ``AutoModelForCausalLM`` (SDPA attention), a token-mean clipped PPO loss over the same
  micro-batches, ``clip_grad_norm_`` and torch's fused AdamW: what TRL's GRPOTrainer runs per step.

Prints the median seconds per step of each (taking turns, ``--repeats`` after one warm-up) and the ratios;
``--profile`` adds each one's top operators (self CPU time).
Usage: python tools/bench/bench_train_phase.py [--hidden 512 --layers 8 --rows 64 --seq 24 --repeats 5 --profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def ours(model_dir: str, micro_batch_size: int, fused: bool):
    """A step function running our forward-backward and optimizer step on ``batch``."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.config.schema import Config, from_dict
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.trainer import optim
    from megatron_grpo.trainer.step import TrainStep

    cfg = from_dict(Config, {"policy": {"model_name": model_dir, "train_micro_batch_size": micro_batch_size},
                             "grpo": {"deployed_improvement": False}})
    fuse = optim.fuse_wgrad_accumulation
    optim.fuse_wgrad_accumulation = fuse if fused else (lambda model: 0)
    try:
        model = optim.wrap_model(build_from_hf(model_dir, params_dtype=torch.float32)[0], cfg)
    finally:
        optim.fuse_wgrad_accumulation = fuse
    optimizer = optim.Optimizer(model, cfg)
    step = TrainStep(model, optimizer, cfg, ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())
    step.shadow_sampled_out = True

    def run(batch):
        step.current_step, step.nonfinite = 1, []
        optimizer.zero_grad()
        step.forward_backward(batch, None, None)
        optimizer.step()
    return run


def transformers_step(model_dir: str, micro_batch_size: int, eps: float = 0.2):
    """A step function: transformers' forward-backward with a token-mean clipped PPO loss + fused AdamW."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def run(batch):
        packed, adv = batch.packed, batch.advantages
        opt.zero_grad()
        for i in range(0, packed.input_ids.shape[0], micro_batch_size):
            rows = slice(i, i + micro_batch_size)
            logits = model(packed.input_ids[rows]).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, packed.labels[rows].unsqueeze(-1)).squeeze(-1)
            ratio, a = torch.exp(lp - lp.detach()), adv[rows].unsqueeze(-1)
            per_token = torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
            (-(per_token * packed.mask[rows]).sum() / packed.mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq", type=int, default=24)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also print each run's top operators")
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.set_num_threads(1)
    from bench_optimizer import _batch, make_model  # tools/ sibling

    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=1))
    model_dir = make_model(tempfile.mkdtemp(prefix="bench-train-"), args.hidden, args.layers, 3 * args.hidden,
                           args.hidden // 64, max(1, args.hidden // 256), 1024)
    batch = _batch(1024, args.rows, args.seq, 0, 1)
    runs = {"ours": ours(model_dir, args.micro_batch_size, True),
            "ours-unfused": ours(model_dir, args.micro_batch_size, False),
            "transformers": transformers_step(model_dir, args.micro_batch_size)}
    times = {name: [] for name in runs}
    for _ in range(1 + args.repeats):  # taking turns; the first round is a warm-up
        for name, run in runs.items():
            start = time.perf_counter()
            run(batch)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t[1:]) for name, t in times.items()}
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers; {args.rows} x {args.seq} tokens, micro-batches of "
          f"{args.micro_batch_size}; one thread; median of {args.repeats} steps after a warm-up, taking turns")
    for name, seconds in median.items():
        print(f"{name:<14} {seconds:8.3f} s/step  {seconds / median['transformers']:5.2f}x transformers")
    if args.profile:
        from torch.profiler import profile

        for name, run in runs.items():
            with profile() as prof:
                run(batch)
            print(f"== {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    state.destroy()


if __name__ == "__main__":
    main()
