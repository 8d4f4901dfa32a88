"""Saving and loading a run (collective over all ranks) with ``megatron.core.dist_checkpointing``.

A checkpoint folder holds the torch_dist files of the model and optimizer state (every rank
writes the shards it owns, in parallel; ``sharded_state.py`` says what they hold) and
``trainer_state.pt`` (rank 0): step, policy version, data position, staleness and skip counters,
the parity baseline, every rank's RNG states, the LR scheduler's and loss scalers' state dicts
and the optimizer's step count. ``folders.py`` makes it atomic (temporary folder, manifest,
rename, ``latest`` last) and verifies it on load.

No rank gathers the model or the optimizer state: with TP / PP / DP / EP each rank writes and reads
only its own part, and a checkpoint loads at another TP / PP / DP (/ EP) layout and pipeline split,
with or without the distributed optimizer (state resharded, see ``sharded_state.py``). Replicated
shards are written by one data-parallel rank each, spread over the DP group (Megatron's fully parallel
save strategy), and read the same way (its fully parallel load: each replicated shard is read by one
DP rank and broadcast to the others; ``checkpointing.fully_parallel_load``). The layout a checkpoint
was saved at is recorded; a checkpoint this run cannot load (another model) is an error naming both.

With ``checkpointing.async_save`` Megatron's asynchronous save is used: the shards are
snapshotted when the save starts (on GPU copied to host memory; on CPU the writer process is
forked, so its copy-on-write view is the snapshot) and written by a background process while
training goes on; the next save (or the end of the run, ``finish_pending_save``) waits for it and
finalizes the checkpoint. Until then ``latest`` names the previous checkpoint, so a crash in
between resumes from that one.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import multiprocessing
import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from megatron_grpo.checkpoint import folders as ckpt
from megatron_grpo.checkpoint import sharded_state
from megatron_grpo.checkpoint.export import export_hf
from megatron_grpo.compat.megatron import async_save_kwargs, keep_checkpoint_writer_errors, set_write_results_queue
from megatron_grpo.parallel import comm
from megatron_grpo.rollout.parity import ProbeBatch

logger = logging.getLogger(__name__)

FORMAT = 2
"""``trainer_state.pt``'s ``format``: 2 = dist_checkpointing (1, HF safetensors, is no longer read)."""


_pending = None
"""The asynchronous save in flight (``checkpointing.async_save``): finalized by ``finish_pending_save``."""


@dataclasses.dataclass
class _PendingSave:
    queue: object
    out: ckpt.CheckpointWriter
    cfg: object
    step: int


def save_checkpoint(trainer) -> str:
    """Writes step ``trainer.step`` atomically under ``checkpointing.checkpoint_dir``; returns its folder.
    A failed write on any rank (a full disk) removes the partial folder and raises, on every rank,
    a ``CheckpointError`` naming the file. With ``checkpointing.async_save`` the shards are written
    in the background and the checkpoint is finalized (manifest, rename, ``latest``) by the next
    save or by ``finish_pending_save`` (the end of the run)."""
    global _pending
    finish_pending_save()
    ctx, cfg = trainer.ctx, trainer.cfg.checkpointing
    tmp = os.path.join(cfg.checkpoint_dir, f".step_{trainer.step:07d}.tmp")
    out = ckpt.CheckpointWriter(tmp, ctx.rank == 0)
    _raise_agreed(out.error)
    opt = ctx.optimizer
    step = _agreed_max(sharded_state.optimizer_step(opt.megatron))
    group_step = _agreed_optional_max(sharded_state.optimizer_group_step(opt.megatron))  # FusedAdam's
    with_state = bool(_agreed_max(int(sharded_state.has_state(opt.megatron))))
    main = bool(_agreed_max(int(sharded_state.has_separate_main_params(opt.megatron))))
    error, request = None, None
    try:
        request = save_sharded(ctx.model, opt, tmp, with_state, async_save=cfg.async_save)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = _save_failure(exc, tmp)
    _raise_first_error(error, tmp, ctx.rank)
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, ckpt.rng_state())
    layout = sharded_state.layout_record(ctx.model)
    in_flight = trainer.in_flight_state() if ctx.rank == 0 else []  # rank 0 holds the generator and writes
    out.write(ckpt.STATE_FILE, lambda path: torch.save(
        trainer_state(trainer, rngs, step, with_state, main, group_step, layout, in_flight), path))
    if request is None:
        return _finalize(out, cfg, trainer.step)
    _raise_agreed(out.error)

    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    _pending = _PendingSave(queue, out, cfg, trainer.step)
    return ckpt.step_dir(cfg.checkpoint_dir, trainer.step)


def finish_pending_save() -> Optional[str]:
    """Collective: waits for the asynchronous save in flight (if any) and finalizes it; returns
    its folder. A failed background write is a ``CheckpointError`` (partial folder removed)."""
    global _pending
    if _pending is None:
        return None
    pending, _pending = _pending, None
    error = None
    try:
        pending.queue.maybe_finalize_async_calls(blocking=True)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException (BaseException) from the writers
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = _save_failure(exc, pending.out.tmp)
    finally:
        pending.queue.close()
    _raise_first_error(error, pending.out.tmp, dist.get_rank())
    return _finalize(pending.out, pending.cfg, pending.step)


def _finalize(out: ckpt.CheckpointWriter, cfg, step: int) -> str:
    """Rank 0 writes the manifest, renames the folder and moves ``latest``; the result (or its
    error) on every rank."""
    final = out.finalize(cfg.checkpoint_dir, step, cfg.keep_last_n)
    if final:
        logger.info("saved checkpoint %s", final)
    dist.barrier()
    result = comm.broadcast_object(out.error or final)
    if isinstance(result, BaseException):
        raise result
    return result


def save_sharded(model, optimizer, path: str, with_state: bool, async_save: bool = False):
    """Collective: the model's and the optimizer's sharded state dicts into the empty folder
    ``path`` (torch_dist), each rank writing its own shards; with ``async_save`` the writes are
    left to the returned ``AsyncRequest``."""
    _use_fork_write_queue()
    model_sd = sharded_state.model_sharded_state_dict(model)
    optim_sd = sharded_state.optimizer_sharded_state_dict(optimizer.megatron, model_sd, with_state)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                ps.get_data_parallel_group(with_context_parallel=True))
    return dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd}, path, sharded_strategy=strategy,
                                   async_sharded_save=async_save, **(async_save_kwargs() if async_save else {}))


class _ForkWriteQueue:
    """The torch_dist writers' results queue without a helper process (see ``_use_fork_write_queue``)."""

    def __init__(self):
        self._queue = multiprocessing.get_context("fork").Queue()

    def put(self, item) -> None:
        self._queue.put(item)

    def get_nowait(self):
        """Called once the writers are done (their results put, possibly still in the feeder thread's
        pipe): waits briefly instead of failing on a not-yet-flushed queue."""
        return self._queue.get(timeout=60)


def _use_fork_write_queue() -> None:
    """Megatron-Core's torch_dist writer collects the writer processes' results through a
    spawn-mode ``multiprocessing.Manager``: a helper process that outlives a SIGKILLed trainer,
    keeping its stdout/stderr open (a launcher waiting for them hangs), and that needs ``__main__``
    guards in every entry point. The writers are forked (synchronous and asynchronous saves
    alike), so a fork-context queue does the same job without a helper process."""
    set_write_results_queue(_ForkWriteQueue)
    keep_checkpoint_writer_errors()


def load_sharded(model, optimizer, path: str, step: int, with_state: bool, main_params: bool,
                 group_step: Optional[int] = None, fully_parallel: bool = True) -> None:
    """Collective: fills this rank's model weights and optimizer state (allocated if fresh) from
    the torch_dist files of checkpoint ``path``, at this run's layout; ``step`` / ``group_step``:
    the saved per-parameter / param-group Adam step counts (``sharded_state.restore_step``).
    ``fully_parallel``: shards replicated over data parallelism are read once, spread over the DP
    group, and broadcast (Megatron's ``FullyParallelLoadStrategyWrapper``); else every replica reads them."""
    model_sd = sharded_state.model_sharded_state_dict(model)
    sharded_state.match_checkpoint_keys(model_sd, sharded_state.checkpoint_keys(path))  # TE <-> local layers
    sharded_state.check_model_shapes(model_sd, path)
    optim_sd = sharded_state.optimizer_sharded_state_dict(optimizer.megatron, model_sd, with_state,
                                                          for_loading=True, main_params=main_params)
    group, strategy = ps.get_data_parallel_group(with_context_parallel=True), None
    if fully_parallel and comm.group_size(group) > 1:  # 0.16.1 and 0.19 alike (0.19: the path is optional)
        strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path), group)
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, path, sharded_strategy=strategy)
    sharded_state.load_model_state(model, loaded["model"])
    with torch.no_grad():
        for key, pieces in optim_sd.items():
            for piece, tensor in zip(pieces, loaded["optimizer"][key]):
                if tensor.data_ptr() != piece.data.data_ptr():
                    piece.data.copy_(tensor)
    sharded_state.restore_step(optimizer.megatron, step, with_state, group_step)
    if not main_params and sharded_state.has_separate_main_params(optimizer.megatron):
        optimizer.megatron.reload_model_params()  # fp32 main params from the (checkpoint's) weights


def trainer_state(trainer, rngs, optimizer_step: int, optimizer_state: bool, main_params: bool,
                  optimizer_group_step: Optional[int] = None, layout: Optional[dict] = None,
                  in_flight: Optional[list] = None) -> dict:
    """What ``trainer_state.pt`` holds (plain data: loadable with ``weights_only=True``). Adam's step
    count in both forms: per parameter (torch's Adam / AdamW) and per param group (TE's / Apex's
    FusedAdam; None without); ``layout``: ``sharded_state.layout_record`` of the saving run;
    ``in_flight``: the generations submitted ahead (``GRPOTrainer.in_flight_state``)."""
    ctx = trainer.ctx
    opt = ctx.optimizer
    return {"format": FORMAT, "step": trainer.step, "version": trainer.version,
            "data_position": ctx.sampler.position, "dropped_stale": trainer.gate.dropped,
            "consecutive_skips": trainer.consecutive_skips, "parity": _parity_state(trainer), "rng": rngs,
            "optimizer_step": optimizer_step, "optimizer_group_step": optimizer_group_step,
            "optimizer_state": optimizer_state, "main_params": main_params,
            "scheduler": opt.scheduler.state_dict(), "scalers": _scaler_states(opt),
            "model_dir": getattr(ctx, "model_dir", None), "layout": layout, "in_flight": list(in_flight or [])}


def _scaler_states(opt) -> list:
    """The fp16 loss scalers' state dicts with host tensors: Megatron's scale lives on this rank's
    GPU, and a CUDA tensor in ``trainer_state.pt`` would be restored onto the GPU it was saved from."""
    return [_on_host(o.grad_scaler.state_dict()) if getattr(o, "grad_scaler", None) else None
            for o in sharded_state.chained(opt.megatron)]


def _on_host(state: dict) -> dict:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _agreed_optional_max(value: Optional[int]) -> Optional[int]:
    """The max over ranks of a count (>= 0), None where no rank has one."""
    agreed = _agreed_max(-1 if value is None else value)
    return None if agreed < 0 else agreed


def _agreed_max(value: int) -> int:
    flag = torch.tensor(float(value), device=comm.collective_device())
    return int(comm.all_reduce_max(flag, comm.world_group()).item())


def _raise_first_error(error: Optional[ckpt.CheckpointError], tmp: str, rank: int) -> None:
    """Every rank's save error gathered: if any rank failed, rank 0 removes the partial folder and
    every rank raises the first error (by rank)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else str(error))
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return
    if rank == 0:
        ckpt.remove_partial(tmp)
    raise ckpt.CheckpointError(first)


def _raise_agreed(error: Optional[BaseException]) -> None:
    """Rank 0's error (or None), raised on every rank."""
    error = comm.broadcast_object(error)
    if error is not None:
        raise error


def _save_failure(exc: BaseException, tmp: str) -> ckpt.CheckpointError:
    """A ``CheckpointError`` naming the file whose write failed. torch's ``CheckpointException``
    lists the failing ranks (``failures``); a writer's ``OSError`` does not carry the file name,
    so the failing rank's shard files (``__<rank>_<n>.distcp``) are named."""
    failures = getattr(exc, "failures", None) or {}
    for rank, wrapped in sorted(failures.items()):
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        inner = _root_cause(inner)
        files = sorted(glob.glob(os.path.join(tmp, f"__{rank}_*.distcp")))
        path = getattr(inner, "filename", None) or (", ".join(files) if files else os.path.join(tmp, f"__{rank}_*.distcp"))
        return ckpt.write_failure(path, inner, tmp)
    inner = _root_cause(exc)
    return ckpt.write_failure(getattr(inner, "filename", None) or tmp, inner, tmp)


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost cause (a writer's ``OSError`` under Megatron's 'Worker failure' wrapper)."""
    seen = set()
    while getattr(exc, "__cause__", None) is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


def export_last(trainer) -> None:
    """Collective: rank 0 exports the latest checkpoint to ``checkpointing.export_hf`` (a Hugging
    Face model folder); an error is raised on every rank."""
    cfg, result = trainer.cfg.checkpointing, None
    if trainer.ctx.rank == 0:
        try:
            export_hf(cfg.checkpoint_dir, cfg.export_hf, model_dir=trainer.ctx.model_dir)
        except (ckpt.CheckpointError, OSError, ValueError) as exc:
            result = ckpt.CheckpointError(f"checkpointing.export_hf={cfg.export_hf}: {exc}")
    result = comm.broadcast_object(result)
    if result is not None:
        raise result
    logger.info("exported the last checkpoint to %s", cfg.export_hf)


def find_resume_dir(trainer) -> Optional[str]:
    """Rank 0 picks (and verifies) the checkpoint to resume from; every rank gets the answer."""
    cfg = trainer.cfg.checkpointing
    result = None
    if trainer.ctx.rank == 0:
        try:
            result = ckpt.resolve_for_load(cfg.checkpoint_dir, cfg.fallback_to_previous)
        except ckpt.CheckpointError as exc:
            result = exc
    result = comm.broadcast_object(result)
    if isinstance(result, Exception):
        raise result
    return result


def load_checkpoint(trainer, path: str) -> None:
    """Restores model, optimizer and trainer state from ``path`` at this run's (any) layout."""
    ctx = trainer.ctx
    opt = ctx.optimizer
    state = ckpt.read_trainer_state(path)
    if state.get("format") != FORMAT:
        raise ckpt.CheckpointError(f"{os.path.join(path, ckpt.STATE_FILE)}: checkpoint format "
                                   f"{state.get('format', 1)} (HF safetensors) is no longer read; this version "
                                   f"reads format {FORMAT} (dist_checkpointing)")
    try:
        load_sharded(ctx.model, opt, path, state["optimizer_step"], state["optimizer_state"], state["main_params"],
                     state.get("optimizer_group_step"),  # absent from checkpoints written before it was saved
                     fully_parallel=trainer.cfg.checkpointing.fully_parallel_load)
    except BaseException as exc:  # noqa: BLE001 - CheckpointingException / CheckpointException (BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise ckpt.CheckpointError(
            f"checkpoint {path} was saved at {sharded_state.format_layout(state.get('layout'))}; this run is at "
            f"{sharded_state.format_layout(sharded_state.layout_record(ctx.model))}: its model/optimizer shards "
            f"cannot be loaded here: {type(exc).__name__}: {str(exc)[:500]}") from exc
    opt.scheduler.load_state_dict(state["scheduler"])
    _load_scalers(opt, state["scalers"])
    trainer.step, trainer.version = state["step"], state["version"]
    trainer.gate.dropped, trainer.consecutive_skips = state["dropped_stale"], state["consecutive_skips"]
    ctx.sampler.position = state["data_position"]
    _restore_parity(trainer, state.get("parity"))
    trainer.restore_in_flight(state.get("in_flight"))  # absent from checkpoints written before it was saved
    rngs = state["rng"]
    ckpt.set_rng_state(rngs[ctx.rank] if ctx.rank < len(rngs) else rngs[0])
    logger.info("resumed from %s (step %d, policy version %d)", path, trainer.step, trainer.version)


def _load_scalers(opt, states: list) -> None:
    """fp16 loss scalers, one per underlying optimizer (the first saved one where counts differ)."""
    opts = sharded_state.chained(opt.megatron)
    saved = [s for s in states if s is not None]
    for i, o in enumerate(opts):
        if getattr(o, "grad_scaler", None) is None or not saved:
            continue
        o.grad_scaler.load_state_dict(states[i] if len(states) == len(opts) and states[i] else saved[0])


def _parity_state(trainer) -> Optional[dict]:
    """The parity probe's sequences and baseline (plain lists / floats), so a resumed run keeps
    comparing against the first probe of the run."""
    if getattr(trainer, "probe", None) is None:
        return None
    return {"sequences": trainer.probe.sequences, "prompt_lens": trainer.probe.prompt_lens,
            "baseline": trainer.parity_baseline}


def _restore_parity(trainer, state: Optional[dict]) -> None:
    if state:
        trainer.probe = ProbeBatch(state["sequences"], state["prompt_lens"])
        trainer.parity_baseline = state["baseline"]
