"""Runs a function on N gloo ranks (spawned processes) and returns each rank's result."""

from __future__ import annotations

import io
import os
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)  # bytes, not shared-memory fds that die with this process
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        from megatron_grpo.parallel import state

        try:
            state.destroy()
        except Exception:  # noqa: BLE001
            pass


def file_barrier(name: str = "start", timeout: float = 600.0) -> None:
    """Every rank of ``run_distributed`` waits here until all have arrived (files, no process group): a
    test that sets a collective timeout of a second or two starts its rendezvous with the ranks aligned,
    not one import (seconds on a loaded machine) apart."""
    folder, rank, world = os.environ["DIST_TEST_DIR"], os.environ["RANK"], int(os.environ["WORLD_SIZE"])
    open(os.path.join(folder, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while sum(f.startswith(f"{name}.") for f in os.listdir(folder)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"file_barrier {name!r}: not every rank arrived in {timeout} s")
        time.sleep(0.005)


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0):
    """``[fn(*args) on rank r for r in range(world_size)]``; raises with the failing rank's traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    folder = tempfile.mkdtemp(prefix="dist-test-")
    os.environ["DIST_TEST_DIR"] = folder  # the spawned ranks inherit it (file_barrier)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
    return [results[r] for r in range(world_size)]
