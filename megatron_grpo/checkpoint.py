"""Checkpoints: layout-independent model + optimizer state, trainer state, atomic writes.

Model weights and the AdamW moments are saved as full HF-named tensors (gathered over
TP/EP with the same name map as the weight push), so a checkpoint written at one
TP/EP layout loads at any other; the same files are a ready HF export. Trainer state
(step, policy version, data position, RNG states of every rank, loss scaler,
staleness counters) goes to ``trainer_state.pt``. A checkpoint is written to a
temporary folder, fsynced, described by ``manifest.json`` (size and sha256 of every
file) and renamed into place; the ``latest`` pointer is replaced last. Loading verifies
the manifest: a truncated or corrupt file is an error naming it, and with
``fallback_to_previous`` the newest intact earlier checkpoint is used instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Dict, List, Optional

import torch

logger = logging.getLogger(__name__)

MODEL_FILE, EXP_AVG_FILE, EXP_AVG_SQ_FILE = "model.safetensors", "optim_exp_avg.safetensors", "optim_exp_avg_sq.safetensors"
STATE_FILE, MANIFEST = "trainer_state.pt", "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def list_checkpoints(root: str) -> List[int]:
    """Steps of the completed checkpoints under ``root`` (temporary folders excluded), ascending."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        if name.startswith("step_") and name[5:].isdigit() and os.path.isdir(os.path.join(root, name)):
            steps.append(int(name[5:]))
    return sorted(steps)


def latest_step(root: str) -> Optional[int]:
    """The step named by the ``latest`` pointer (or the newest folder if the pointer is missing)."""
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            return int(f.read().strip())
    steps = list_checkpoints(root)
    return steps[-1] if steps else None


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize_dir(tmp: str, root: str, step: int, keep_last_n: int) -> str:
    """Writes the manifest, renames ``tmp`` into place, moves ``latest``, prunes old checkpoints."""
    files = sorted(f for f in os.listdir(tmp) if f != MANIFEST)
    manifest = {"step": step, "files": {f: {"bytes": os.path.getsize(os.path.join(tmp, f)),
                                            "sha256": _sha256(os.path.join(tmp, f))} for f in files}}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = step_dir(root, step)
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer_tmp = os.path.join(root, f".latest.tmp{os.getpid()}")
    with open(pointer_tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, os.path.join(root, "latest"))
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep_last_n] if keep_last_n > 0 else []:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    return final


def verify(path: str) -> None:
    """Raises ``CheckpointError`` naming the first missing, truncated or corrupt file of ``path``."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path} is partial: no {MANIFEST}")
    with open(manifest_path) as f:
        manifest = json.load(f)
    for name, meta in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint file {file} is missing")
        if os.path.getsize(file) != meta["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is truncated ({os.path.getsize(file)} of {meta['bytes']} bytes)")
        if _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is corrupt (sha256 mismatch)")


def resolve_for_load(root: str, fallback_to_previous: bool) -> Optional[str]:
    """The checkpoint folder to resume from (verified), or None when there is none."""
    step = latest_step(root)
    if step is None:
        return None
    candidates = [s for s in list_checkpoints(root) if s <= step][::-1]
    errors = []
    for s in candidates if fallback_to_previous else candidates[:1]:
        try:
            verify(step_dir(root, s))
            if errors:
                logger.warning("using checkpoint step %d; newer ones failed: %s", s, "; ".join(errors))
            return step_dir(root, s)
        except CheckpointError as exc:
            errors.append(str(exc))
    hint = "" if fallback_to_previous else " (set checkpointing.fallback_to_previous=true to use an earlier one)"
    raise CheckpointError("; ".join(errors) + hint if errors else f"no checkpoint under {root}")


def rng_state() -> Dict:
    """This rank's RNG states (torch CPU/CUDA and Megatron's named streams)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
