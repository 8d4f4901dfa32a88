"""Saving and loading a run (collective over all ranks); file layout in ``checkpoint.py``."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo import checkpoint as ckpt
from megatron_grpo.models.weights import export_hf_tensors, load_hf_weights
from megatron_grpo.parallel import comm

logger = logging.getLogger(__name__)


def _gather(model, shape, source, keep: bool) -> Optional[dict]:
    """Collective export of per-parameter tensors (every rank joins); HF-named copies where ``keep``."""
    tensors = {}
    for name, tensor in export_hf_tensors(model, shape, include_tied_lm_head=False, source=source):
        if keep:
            tensors[name] = tensor.detach().float().contiguous().clone()
    return tensors if keep else None


def save_checkpoint(trainer) -> str:
    """Writes step ``trainer.step`` atomically under ``checkpointing.checkpoint_dir``; returns its folder.
    A failed write on rank 0 (a full disk) removes the partial folder and, after the collectives,
    raises on every rank a ``CheckpointError`` naming the file."""
    from safetensors.torch import save_file

    ctx, cfg = trainer.ctx, trainer.cfg.checkpointing
    out = ckpt.CheckpointWriter(os.path.join(cfg.checkpoint_dir, f".step_{trainer.step:07d}.tmp"), ctx.rank == 0)
    opt = ctx.optimizer
    files = {ckpt.MODEL_FILE: lambda n, p: opt.master_of(p),
             ckpt.EXP_AVG_FILE: lambda n, p: opt.moment(p, "exp_avg"),
             ckpt.EXP_AVG_SQ_FILE: lambda n, p: opt.moment(p, "exp_avg_sq")}
    for filename, source in files.items():
        tensors = _gather(ctx.model, ctx.shape, source, keep=out.writing)
        out.write(filename, lambda path, tensors=tensors: save_file(tensors, path))
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, ckpt.rng_state())
    out.write(ckpt.STATE_FILE, lambda path: torch.save(_trainer_state(trainer, rngs), path))
    final = out.finalize(cfg.checkpoint_dir, trainer.step, cfg.keep_last_n)
    if final:
        logger.info("saved checkpoint %s", final)
    dist.barrier()
    result = comm.broadcast_object(out.error or final)
    if isinstance(result, Exception):
        raise result
    return result


def _trainer_state(trainer, rngs) -> dict:
    opt = trainer.ctx.optimizer
    return {"step": trainer.step, "version": trainer.version, "data_position": trainer.ctx.sampler.position,
            "dropped_stale": trainer.gate.dropped, "adam_step": opt.adam_step(),
            "scaler": opt.scaler.state_dict() if opt.scaler else None, "rng": rngs,
            "consecutive_skips": trainer.consecutive_skips, "parity": _parity_state(trainer)}


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


def read_trainer_state(path: str) -> dict:
    """The trainer state of checkpoint ``path``, unpickled with ``weights_only=True``: tensors,
    numbers, strings, lists and dicts only, so a tampered file cannot run code on resume."""
    file = os.path.join(path, ckpt.STATE_FILE)
    try:
        return torch.load(file, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError, RuntimeError, ...
        raise ckpt.CheckpointError(f"{file}: cannot be loaded as plain data (weights_only=True): "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc


def load_checkpoint(trainer, path: str) -> None:
    """Restores model, optimizer and trainer state from ``path`` at this run's (any) layout."""
    ctx = trainer.ctx
    opt = ctx.optimizer
    state = read_trainer_state(path)
    load_hf_weights(ctx.model, path, ctx.shape, filename=ckpt.MODEL_FILE, target=lambda n, p: opt.master_of(p))
    opt.sync_params_from_master()
    opt.init_state(state["adam_step"])
    if state["adam_step"] > 0:
        for filename, key in ((ckpt.EXP_AVG_FILE, "exp_avg"), (ckpt.EXP_AVG_SQ_FILE, "exp_avg_sq")):
            load_hf_weights(ctx.model, path, ctx.shape, filename=filename,
                            target=lambda n, p, key=key: opt.adam.state[opt.master_of(p)][key])
    else:
        opt.adam.state.clear()
    if opt.scaler and state["scaler"]:
        opt.scaler.load_state_dict(state["scaler"])
    trainer.step, trainer.version = state["step"], state["version"]
    trainer.gate.dropped, trainer.consecutive_skips = state["dropped_stale"], state["consecutive_skips"]
    ctx.sampler.position = state["data_position"]
    _restore_parity(trainer, state.get("parity"))
    rngs = state["rng"]
    ckpt.set_rng_state(rngs[ctx.rank] if ctx.rank < len(rngs) else rngs[0])
    logger.info("resumed from %s (step %d, policy version %d)", path, trainer.step, trainer.version)


def _parity_state(trainer) -> Optional[dict]:
    """The parity probe's sequences and baseline (plain lists / floats), so a resumed run keeps
    comparing against the first probe of the run."""
    if getattr(trainer, "probe", None) is None:
        return None
    return {"sequences": trainer.probe.sequences, "prompt_lens": trainer.probe.prompt_lens,
            "baseline": trainer.parity_baseline}


def _restore_parity(trainer, state: Optional[dict]) -> None:
    from megatron_grpo.rollout.parity import ProbeBatch

    if state:
        trainer.probe = ProbeBatch(state["sequences"], state["prompt_lens"])
        trainer.parity_baseline = state["baseline"]
