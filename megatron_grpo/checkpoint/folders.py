"""Checkpoint folders: atomic writes, the ``latest`` pointer, manifest and verification.

A checkpoint (``step_<N>/``) holds the torch_dist files of ``megatron.core.dist_checkpointing``
(model and optimizer state, each rank's shards; ``resume.py`` / ``sharded_state.py``) and
``trainer_state.pt`` (step, policy version, data position, RNG states of every rank, LR
scheduler, loss scalers, staleness counters). It is written to a temporary folder by every rank;
after a barrier rank 0 describes it in ``manifest.json`` (the size of every file, and the
sha256 of every file up to ``HASH_MAX_BYTES``), fsyncs it and renames it into place; the
``latest`` pointer is replaced last. Shard files above ``HASH_MAX_BYTES`` are checked by size
only: hashing them would read the whole checkpoint (terabytes for a large model) on rank 0 at
every save and every resume; a truncated shard is still caught, and torch_dist's own metadata
(hashed) names every item's offset and length.

A failed write (a full disk) is a ``CheckpointError`` naming the file, and the partial temporary
folder is removed. Loading verifies the pointer and the manifest: an empty or garbled ``latest``,
a ``latest`` naming a deleted folder, an empty, garbled or malformed ``manifest.json``, a
missing, truncated or corrupt file are each a ``CheckpointError`` naming the file, and with
``fallback_to_previous`` the newest intact earlier checkpoint is used instead (with a warning
naming what was skipped and why).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import string
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

logger = logging.getLogger(__name__)

STATE_FILE, MANIFEST, POINTER = "trainer_state.pt", "manifest.json", "latest"
HASH_MAX_BYTES = 64 << 20
"""Files up to this size get a sha256 in the manifest (metadata, trainer state, small shards)."""


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


def read_pointer(root: str) -> Optional[int]:
    """The step the ``latest`` pointer names, or None without a pointer; a ``CheckpointError``
    naming the pointer when it is unreadable, empty or not a step number."""
    pointer = os.path.join(root, POINTER)
    if not os.path.isfile(pointer):
        return None
    try:
        with open(pointer, "rb") as f:
            text = f.read().decode("utf-8", errors="replace").strip()
    except OSError as exc:
        raise CheckpointError(f"checkpoint pointer {pointer} cannot be read: {exc}") from exc
    if not text:
        raise CheckpointError(f"checkpoint pointer {pointer} is empty (expected a step number)")
    if not (text.isascii() and text.isdigit()):
        raise CheckpointError(f"checkpoint pointer {pointer} does not hold a step number: {text[:40]!r}")
    return int(text)


def latest_step(root: str) -> Optional[int]:
    """The step named by the ``latest`` pointer (or the newest folder if the pointer is missing)."""
    step = read_pointer(root)
    if step is not None:
        return step
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


def write_failure(path: str, exc: BaseException, removed: str) -> CheckpointError:
    """A ``CheckpointError`` naming the file ``path`` whose write failed (a full disk is said so)."""
    text = str(exc)
    full = getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in text or "os error 28" in text
    why = f"the disk is full (ENOSPC: {text})" if full else f"{type(exc).__name__}: {text}"
    return CheckpointError(f"cannot write checkpoint file {path}: {why}; removed the partial {removed}")


@contextlib.contextmanager
def _removed_on_failure(path: str, partial: str):
    """Any failure while writing ``path`` (OSError, torch's RuntimeError, SafetensorError) removes
    ``partial`` (a temporary folder or file) and becomes a ``CheckpointError`` naming ``path``."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every write failure leaves a partial file behind
        remove_partial(partial)
        raise write_failure(path, exc, partial) from exc


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _manifest(tmp: str, step: int) -> Dict:
    files = {}
    for name in sorted(f for f in os.listdir(tmp) if f != MANIFEST):
        path = os.path.join(tmp, name)
        size = os.path.getsize(path)
        files[name] = {"bytes": size, "sha256": _sha256(path) if size <= HASH_MAX_BYTES else None}
    return {"step": step, "files": files}


def remove_partial(path: str) -> None:
    """Removes a partial checkpoint folder or file (nothing if it is gone)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def finalize_dir(tmp: str, root: str, step: int, keep_last_n: int) -> str:
    """Writes the manifest, renames ``tmp`` into place, moves ``latest``, prunes old checkpoints.
    A failed write is a ``CheckpointError`` naming the file: before the rename ``tmp`` is removed;
    after it the checkpoint is complete and ``latest`` still names the previous one."""
    final, manifest = step_dir(root, step), os.path.join(tmp, MANIFEST)
    with _removed_on_failure(manifest, tmp):
        _write_synced(manifest, json.dumps(_manifest(tmp, step), indent=1))
        _fsync_dir(tmp)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    pointer_tmp = os.path.join(root, f".latest.tmp{os.getpid()}")
    with _removed_on_failure(os.path.join(root, POINTER), pointer_tmp):
        _write_synced(pointer_tmp, str(step))
        os.replace(pointer_tmp, os.path.join(root, POINTER))
        _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep_last_n] if keep_last_n > 0 else []:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    return final


class CheckpointWriter:
    """Rank 0's writes of one checkpoint into its temporary folder ``tmp``. The first failure (a
    full disk) removes ``tmp`` and is kept in ``error``, a ``CheckpointError`` naming the file;
    later writes are skipped, so every rank still joins the collectives between the writes."""

    def __init__(self, tmp: str, active: bool):
        self.tmp, self.active, self.error = tmp, active, None
        if active:
            shutil.rmtree(tmp, ignore_errors=True)
            self._attempt(tmp, lambda path: os.makedirs(path))

    @property
    def writing(self) -> bool:
        return self.active and self.error is None

    def write(self, name: str, write: Callable[[str], None]) -> None:
        """``write(path)`` for the checkpoint file ``name``, unless an earlier write failed."""
        if self.writing:
            self._attempt(os.path.join(self.tmp, name), write)

    def finalize(self, root: str, step: int, keep_last_n: int) -> Optional[str]:
        """``finalize_dir`` unless a write failed; the final folder, or None."""
        if not self.writing:
            return None
        try:
            return finalize_dir(self.tmp, root, step, keep_last_n)
        except CheckpointError as exc:
            self.error = exc
            return None

    def _attempt(self, path: str, write: Callable[[str], None]) -> None:
        try:
            with _removed_on_failure(path, self.tmp):
                write(path)
        except CheckpointError as exc:
            self.error = exc


def read_manifest(path: str) -> Dict[str, Dict]:
    """The ``files`` table of checkpoint ``path``'s manifest; a ``CheckpointError`` naming the
    manifest (and the key) when it is missing, unreadable, empty, not JSON or malformed."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path} is partial: no {MANIFEST}")
    try:
        with open(manifest_path, "rb") as f:
            data = f.read()
        manifest = json.loads(data) if data.strip() else None
    except OSError as exc:
        raise CheckpointError(f"checkpoint manifest {manifest_path} cannot be read: {exc}") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"checkpoint manifest {manifest_path} is not valid JSON: {exc}") from exc
    if manifest is None:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is empty")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"checkpoint manifest {manifest_path}: key 'files' is missing, empty or not an object")
    for name, meta in files.items():
        _check_entry(manifest_path, name, meta)
    return files


def _check_entry(manifest_path: str, name: str, meta) -> None:
    plain = name not in ("", ".", "..", MANIFEST) and os.path.basename(name) == name
    size = meta.get("bytes") if isinstance(meta, dict) else None
    digest = meta.get("sha256") if isinstance(meta, dict) else None
    if not plain:
        raise CheckpointError(f"checkpoint manifest {manifest_path}: key 'files.{name}' is not a file name")
    hashed = isinstance(digest, str) and len(digest) == 64 and set(digest) <= set(string.hexdigits)
    size_only = isinstance(meta, dict) and "sha256" in meta and digest is None and type(size) is int \
        and size > HASH_MAX_BYTES
    if type(size) is not int or size < 0 or not (hashed or size_only):
        raise CheckpointError(f"checkpoint manifest {manifest_path}: key 'files.{name}' needs 'bytes' (an integer) "
                              f"and 'sha256' (64 hex digits; null above {HASH_MAX_BYTES} bytes), not {str(meta)[:80]}")


def verify(path: str) -> None:
    """Raises ``CheckpointError`` naming the broken manifest or the first missing, truncated or
    corrupt file of ``path``."""
    for name, meta in read_manifest(path).items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint file {file} is missing")
        try:
            size = os.path.getsize(file)
            digest = _sha256(file) if size == meta["bytes"] and meta["sha256"] else None
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {file} cannot be read: {exc}") from exc
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is truncated ({size} of {meta['bytes']} bytes)")
        if meta["sha256"] and digest != meta["sha256"].lower():
            raise CheckpointError(f"checkpoint file {file} is corrupt (sha256 mismatch)")


def _pointer_target(root: str) -> Tuple[Optional[int], Optional[str]]:
    """``(step named by latest, problem)``: a broken pointer or one naming a missing folder is a problem."""
    try:
        step = read_pointer(root)
    except CheckpointError as exc:
        return None, str(exc)
    if step is not None and not os.path.isdir(step_dir(root, step)):
        return step, (f"checkpoint pointer {os.path.join(root, POINTER)} names step {step}, "
                      f"but {step_dir(root, step)} does not exist")
    return step, None


def resolve_for_load(root: str, fallback_to_previous: bool) -> Optional[str]:
    """The checkpoint folder to resume from (verified), or None when there is none. A broken
    pointer or checkpoint is a ``CheckpointError`` naming the file; with ``fallback_to_previous``
    the newest intact earlier checkpoint is used, with a warning naming what was skipped and why."""
    newest, problem = _pointer_target(root)
    errors = [problem] if problem else []
    steps = [s for s in list_checkpoints(root) if newest is None or s <= newest][::-1]
    if not steps and not errors:
        return None
    for s in steps if fallback_to_previous else ([] if errors else steps[:1]):
        try:
            verify(step_dir(root, s))
        except CheckpointError as exc:
            errors.append(str(exc))
            continue
        if errors:
            logger.warning("resuming from %s; skipped newer checkpoint state: %s", step_dir(root, s), "; ".join(errors))
        return step_dir(root, s)
    hint = "" if fallback_to_previous else " (set checkpointing.fallback_to_previous=true to use an earlier one)"
    raise CheckpointError("; ".join(errors) + hint)


def rng_state() -> Dict:
    """This rank's RNG states (torch CPU/CUDA and Megatron's named streams)."""
    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict) -> None:
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_trainer_state(path: str) -> dict:
    """The trainer state of checkpoint ``path``, unpickled with ``weights_only=True``: tensors,
    numbers, strings, lists and dicts only, so a tampered file cannot run code on resume. Tensors
    load into host memory (``map_location="cpu"``), whatever device wrote them (a checkpoint that
    holds CUDA tensors would otherwise open a context on that GPU from every rank of the node);
    whoever uses one moves it to its own device (Megatron's scaler: the current device)."""
    file = os.path.join(path, STATE_FILE)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError, RuntimeError, ...
        raise CheckpointError(f"{file}: cannot be loaded as plain data (weights_only=True): "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc


NORM_KEY_ALIASES = {
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight",
    "decoder.layers.pre_mlp_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
}
"""The pre-MLP norm's two checkpoint keys (Megatron-Core 0.16.1's layer specs): the local spec's
``sharded_state_dict_keys_map`` renames it to Transformer Engine's fused name
``mlp.linear_fc1.layer_norm_weight`` in every layer, as TE's dense layers save it (the norm is
part of ``TELayerNormColumnParallelLinear``); TE's MoE layers have a separate ``TENorm`` and a key
map that renames op-fuser names only, so they save ``pre_mlp_layernorm.weight``. A checkpoint of
either spec loads into the other (and exports) through this alias. The input norm needs none:
both specs save it as ``self_attention.linear_qkv.layer_norm_weight``."""
