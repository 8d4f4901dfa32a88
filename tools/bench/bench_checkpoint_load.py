"""Benchmark: bytes each rank reads resuming a checkpoint, every replica reading vs the fully parallel load.

Spawns ``--dp x --pp`` gloo ranks on a Qwen3-shaped random-init model (default
~25M params: hidden 512, 8 layers; made with ``megatron_grpo/models/tiny.py``), makes one optimizer update
(so the checkpoint holds Adam's moments), saves it with ``checkpoint/resume.py``'s ``save_sharded`` and loads
it into a fresh model and optimizer twice with ``load_sharded``: ``fully_parallel=False`` (every
data-parallel replica reads the shards it needs) and ``True`` (Megatron's ``FullyParallelLoadStrategyWrapper``:
each replicated shard read by one DP rank, then broadcast). ``read_bytes`` counts what torch_dist reads
from the checkpoint files on this rank (each read item is a saved chunk, read whole:
``FileSystemReader.read_data``). Prints, per rank, the bytes read and the load time of both.
Usage: python tools/bench/bench_checkpoint_load.py [--hidden 512 --layers 8 --dp 2 --pp 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time


@contextlib.contextmanager
def read_bytes():
    """Counts the bytes torch_dist reads from checkpoint files on this rank: ``with read_bytes() as n: ...``,
    then ``n[0]``."""
    from torch.distributed.checkpoint import FileSystemReader

    real, count = FileSystemReader.read_data, [0]

    def read_data(self, plan, planner):
        count[0] += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return real(self, plan, planner)

    FileSystemReader.read_data = read_data
    try:
        yield count
    finally:
        FileSystemReader.read_data = real


def _build(model_dir: str):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config.schema import Config, from_dict
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.trainer.optim import Optimizer, wrap_model
    from megatron_grpo.trainer.step import TrainStep

    cfg = from_dict(Config, {"policy": {"model_name": model_dir, "train_micro_batch_size": 2},
                             "grpo": {"deployed_improvement": False}})
    model = wrap_model(build_from_hf(model_dir)[0], cfg)
    optimizer = Optimizer(model, cfg)
    return model, optimizer, TrainStep(model, optimizer, cfg, ps.get_tensor_model_parallel_group(),
                                       ps.get_data_parallel_group())


def _update(step, vocab: int) -> None:
    """One optimizer update on a random batch (this rank's half): Adam's moments exist afterwards."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_grpo.rollout import Rollout, Rollouts
    from megatron_grpo.trainer.step import build_step_batch

    gen = torch.Generator().manual_seed(0)
    items = [Rollout(i, torch.randint(5, vocab, (8,), generator=gen).tolist(),
                     torch.randint(5, vocab, (8,), generator=gen).tolist(), [-7.0] * 8, "length", 0) for i in range(4)]
    batch = build_step_batch(Rollouts(items), torch.randn(4, generator=gen), ps.get_data_parallel_rank(),
                             ps.get_data_parallel_world_size(), pad_id=0)
    step.current_step, step.nonfinite = 1, []
    step.optimizer.zero_grad()
    step.forward_backward(batch, None, None)
    step.optimizer.step()


def run_rank(model_dir: str, root: str, pp: int) -> list:
    """This rank's bytes read and load seconds, every replica reading vs the fully parallel load."""
    import torch.distributed as dist

    from megatron_grpo.checkpoint import resume
    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=int(os.environ["WORLD_SIZE"]), pp=pp))
    model, optimizer, step = _build(model_dir)
    _update(step, 1024)  # below every tiny model's vocabulary
    path = os.path.join(root, "ckpt")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    resume.save_sharded(model, optimizer, path, with_state=True)
    out = {"rank": dist.get_rank()}
    for fully_parallel in (False, True):
        model, optimizer, _ = _build(model_dir)
        dist.barrier()
        start = time.perf_counter()
        with read_bytes() as nbytes:
            resume.load_sharded(model, optimizer, path, step=1, with_state=True, main_params=False,
                                fully_parallel=fully_parallel)
        out["fully_parallel" if fully_parallel else "every_replica"] = (nbytes[0], time.perf_counter() - start)
    out["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    state.destroy()
    return gathered


def print_table(ranks, args) -> None:
    print(f"checkpoint: {ranks[0]['checkpoint_bytes']:,} bytes of shards (model + Adam state, fp32); "
          f"DP={args.dp} x PP={args.pp} gloo ranks; hidden {args.hidden}, {args.layers} layers")
    print(f"{'rank':>4} {'every replica: bytes':>22} {'s':>6} {'fully parallel: bytes':>23} {'s':>6}")
    for r in ranks:
        (b0, t0), (b1, t1) = r["every_replica"], r["fully_parallel"]
        print(f"{r['rank']:>4} {b0:>22,} {t0:>6.2f} {b1:>23,} {t1:>6.2f}")


def _spawned(rank: int, world: int, port: int, model_dir: str, root: str, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    ranks = run_rank(model_dir, root, args.pp)
    if rank == 0:
        print_table(ranks, args)


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    from megatron_grpo.models.tiny import make_tiny_model, sized_overrides

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-ckpt-load-")
    model_dir = make_tiny_model(os.path.join(root, "model"), "qwen3", overrides=sized_overrides(args.hidden, args.layers))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.dp * args.pp
    mp.start_processes(_spawned, args=(world, port, model_dir, root, args), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
