"""Runs a function on N gloo ranks (spawned processes) and returns each rank's result."""

from __future__ import annotations

import io
import os
import random
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def _ephemeral_low(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, drawn at random: a port that ``bind(0)``
    hands out is ephemeral, and between its release and the store's bind any outgoing connection (gloo's,
    another test's) may take it (EADDRINUSE, seen in CI with two lanes side by side)."""
    rng, high = random.SystemRandom(), _ephemeral_low()
    for _ in range(200):
        port = rng.randrange(20000, max(high, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0, attempts: int = 3):
    """``[fn(*args) on rank r for r in range(world_size)]``; raises with the failing rank's traceback. A
    rendezvous port taken by another process between its choice and the store's bind (EADDRINUSE, before
    ``fn`` did anything) is retried on a new port."""
    for attempt in range(attempts):
        try:
            return _run_once(fn, world_size, args, timeout)
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == attempts - 1:
                raise


def _run_once(fn, world_size: int, args, timeout: float):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
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
