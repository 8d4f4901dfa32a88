"""Benchmark: Megatron-Core's distributed optimizer vs the replicated one at DP=2, side by side in one run.

Two gloo ranks (spawned here; or ``torchrun --nproc-per-node 2 tools/bench/bench_optimizer.py``), a
Qwen3-shaped random-init model (default ~26M params: hidden 512, 8 layers, FFN 1536, 8 heads / 4 KV
heads, vocab 1024; made with ``megatron_grpo/models/tiny.py``). For each optimizer the same steps on
the same batch (each rank its half) through ``TrainStep.forward_backward`` and ``Optimizer.step``:

- grad sync: ``finalize_model_grads`` (DDP's all-reduce of the grad buffer; reduce-scatter with the
  distributed optimizer), after a barrier so it excludes waiting for the other rank's backward;
- optimizer step: ``Optimizer.step`` (grad norm, clip, Adam on this rank's params or shard; the
  distributed optimizer also all-gathers the updated params: the "(gather)" column, included).

Prints, per rank, the optimizer state bytes (``Optimizer.state_bytes``) and DDP's grad / param
buffers, and the median times over ``--repeats`` steps after one warm-up step.
Usage: python tools/bench/bench_optimizer.py [--hidden 512 --layers 8 --ffn 1536 --params-dtype float32]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

MODES = ("replicated", "distributed", "unfused")
"""unfused: the replicated optimizer with torch's default AdamW path on CPU (what Megatron-Core builds
without TE / Apex), before ``parallel.cpu.fuse_torch_adam`` switches it to the fused kernel."""


def make_model(out_dir: str, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> str:
    from megatron_grpo.models.tiny import make_tiny_model

    overrides = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads)
    return make_tiny_model(out_dir, "qwen3", overrides=overrides)


def _batch(vocab: int, rows: int, seq: int, dp_rank: int, dp_size: int):
    import torch

    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.trainer.step import build_step_batch

    gen = torch.Generator().manual_seed(0)
    prompt = seq // 4
    items = []
    for i in range(rows):
        ids = torch.randint(5, vocab, (seq,), generator=gen).tolist()
        items.append(Rollout(i // 4, ids[:prompt], ids[prompt:], [-7.0] * (seq - prompt), "length", 0))
    return build_step_batch(Rollouts(items), torch.randn(rows, generator=gen), dp_rank, dp_size, pad_id=0)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _timed_syncs(model, config):
    """Times the gradient sync (``finalize_model_grads_func``: one entry per step) and the distributed
    optimizer's all-gather of the updated params (summed into ``gather[0]``); returns ``(sync_times, gather)``."""
    import torch.distributed as dist

    finalize, sync_times = config.finalize_model_grads_func, []

    def timed_finalize(*a, **k):
        dist.barrier()
        start = time.perf_counter()
        finalize(*a, **k)
        sync_times.append(time.perf_counter() - start)

    config.finalize_model_grads_func = timed_finalize
    param_sync, gather = model.start_param_sync, [0.0]

    def timed_param_sync(*a, **k):  # the distributed optimizer's all-gather of the updated params
        start = time.perf_counter()
        param_sync(*a, **k)
        gather[0] += time.perf_counter() - start

    model.start_param_sync = timed_param_sync
    return sync_times, gather


def bench_mode(model_dir: str, mode: str, args) -> dict:
    """This rank's bytes and median times for one optimizer."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.config.schema import Config, from_dict
    from megatron_grpo.models import build_from_hf, unwrap
    from megatron_grpo.trainer.optim import Optimizer, wrap_model
    from megatron_grpo.trainer.step import TrainStep

    dtype = args.params_dtype
    cfg = from_dict(Config, {"policy": {"model_name": model_dir, "train_micro_batch_size": args.rows,
                                        "precision": {"params_dtype": dtype, "compute_dtype": dtype},
                                        "megatron_cfg": {"optimizer": {"lr": 1e-5, "use_distributed_optimizer":
                                                                       mode == "distributed"}}},
                             "grpo": {"deployed_improvement": False}})
    model = wrap_model(build_from_hf(model_dir, params_dtype=getattr(torch, dtype))[0], cfg)
    optimizer = Optimizer(model, cfg)
    if mode == "unfused":
        for opt in optimizer.chained:
            for group in [opt.optimizer.defaults, *opt.optimizer.param_groups]:
                group["fused"], group["foreach"] = None, None
    step = TrainStep(model, optimizer, cfg, ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())
    sync_times, gather = _timed_syncs(model, unwrap(model).config)
    batch = _batch(args.vocab, args.rows, args.seq, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    fwd_bwd, opt_times, gather_times = [], [], []
    for i in range(1 + args.repeats):
        step.current_step, step.nonfinite = i, []
        optimizer.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        step.forward_backward(batch, None, None)
        fwd_bwd.append(time.perf_counter() - start)
        dist.barrier()
        gather[0], start = 0.0, time.perf_counter()
        out = optimizer.step()
        opt_times.append(time.perf_counter() - start)
        gather_times.append(gather[0])
        assert out["train/skipped_nonfinite"].item() == 0
    buffers = model.buffers + model.expert_parallel_buffers
    params = [b.param_data for b in buffers if b.param_data is not None] or list(model.parameters())
    median = lambda xs: statistics.median(xs[1:])  # noqa: E731 - drop the warm-up step
    sync = median(sync_times)
    return {"state_bytes": optimizer.state_bytes(), "grad_bytes": _bytes(b.grad_data for b in buffers),
            "param_bytes": _bytes(params), "num_params": sum(p.numel() for p in model.parameters()),
            "compute_s": median(fwd_bwd) - sync, "sync_s": sync, "step_s": median(opt_times),
            "gather_s": median(gather_times),
            "optimizer": type(optimizer.chained[0]).__name__}


def run_rank(model_dir: str, args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_grpo.parallel import state

    torch.set_num_threads(1)
    state.initialize_model_parallel(state.Layout(world_size=int(os.environ["WORLD_SIZE"])))
    results = {mode: bench_mode(model_dir, mode, args) for mode in MODES}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        print_table(gathered, args)
    state.destroy()


def print_table(ranks, args) -> None:
    mib = 1024 ** 2
    first = ranks[0]["replicated"]
    print(f"model: Qwen3-shaped, {first['num_params'] / 1e6:.1f}M params in {args.params_dtype} (hidden {args.hidden}, "
          f"{args.layers} layers, FFN {args.ffn}, vocab {args.vocab}); DP={len(ranks)} gloo ranks, "
          f"{args.rows} rows x {args.seq} tokens per step; median of {args.repeats} steps after a warm-up")
    print(f"{'optimizer':<12} {'rank':>4} {'opt state MiB':>14} {'grad buf MiB':>13} {'param MiB':>10} "
          f"{'fwd-bwd ms':>11} {'grad sync ms':>13} {'opt step ms':>12} {'(gather) ms':>12} {'sync+step ms':>13}")
    for mode in MODES:
        for rank, results in enumerate(ranks):
            r = results[mode]
            print(f"{mode:<12} {rank:>4} {r['state_bytes'] / mib:>14.1f} {r['grad_bytes'] / mib:>13.1f} "
                  f"{r['param_bytes'] / mib:>10.1f} {r['compute_s'] * 1e3:>11.1f} {r['sync_s'] * 1e3:>13.1f} "
                  f"{r['step_s'] * 1e3:>12.1f} {r['gather_s'] * 1e3:>12.1f} {(r['sync_s'] + r['step_s']) * 1e3:>13.1f}")
    rep, dis = ranks[0]["replicated"], ranks[0]["distributed"]
    print(f"distributed / replicated on rank 0: optimizer state {dis['state_bytes'] / rep['state_bytes']:.2f}x, "
          f"grad sync {dis['sync_s'] / rep['sync_s']:.2f}x, optimizer step {dis['step_s'] / rep['step_s']:.2f}x, "
          f"sync + step {(dis['sync_s'] + dis['step_s']) / (rep['sync_s'] + rep['step_s']):.2f}x")
    unf = ranks[0]["unfused"]
    print(f"fused / unfused torch AdamW (replicated) on rank 0: optimizer step {rep['step_s'] / unf['step_s']:.2f}x "
          f"({rep['step_s'] * 1e3:.0f} ms vs {unf['step_s'] * 1e3:.0f} ms)")


def _spawned(rank: int, world: int, port: int, model_dir: str, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    run_rank(model_dir, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF Qwen3 dir (default: make one with the sizes below)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=8, help="sequences per step (split over the 2 ranks)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model_dir = args.model
    if "RANK" in os.environ:  # torchrun: the model must exist already, or every rank makes its own copy
        model_dir = model_dir or make_model(tempfile.mkdtemp(prefix=f"bench-opt-{os.environ['RANK']}-"), args.hidden,
                                            args.layers, args.ffn, args.heads, args.kv_heads, args.vocab)
        run_rank(model_dir, args)
        return
    import torch.multiprocessing as mp

    model_dir = model_dir or make_model(tempfile.mkdtemp(prefix="bench-opt-"), args.hidden, args.layers, args.ffn,
                                        args.heads, args.kv_heads, args.vocab)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(rank, 2, port, model_dir, args)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")


if __name__ == "__main__":
    main()
