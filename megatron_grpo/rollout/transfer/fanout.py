"""One gather, fan-out push: each weight bucket is published once and every engine reads it.

The trainer gathers a bucket (``weight_sync.hf_buckets``, collective over TP/EP) exactly once,
whatever the number of engines. A ``Fanout`` turns that bucket into something every engine can
load concurrently:

- ``SharedFileFanout`` (CPU, one host; what runs today): one safetensors file under /dev/shm,
  hard-linked once per engine. Each engine's worker reads its link and unlinks it, so the bytes
  are freed when the last engine has read them: one write, N concurrent reads. At most
  ``max_in_flight`` buckets are unread at a time (memory stays ~2 buckets, not the model).
  The folder must hold ``max_in_flight`` buckets: before each write its free space is checked
  (``os.statvfs``); a full /dev/shm (Docker gives 64 MiB) falls back to the temp dir on disk
  with a warning, and an error names both folders and sizes when neither fits.
- vLLM's weight-transfer API (``generation.weight_transfer`` gloo / nccl / ipc: ``transport.py``):
  each engine streams the buckets itself; ``fan_out_streams`` hands every bucket to every
  engine's stream (one thread each).

``fan_out`` drives the files: one thread per engine feeds that engine's bucket handles in
order, so a slow engine never stalls the gather, and a dead engine is dropped from the push
(and its unread buckets freed) while the others finish theirs.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

Bucket = List[Tuple[str, torch.Tensor]]

UNKNOWN_VERSION = -1
"""An engine's version after a push the trainer aborted (a failed gather): some buckets loaded, some
not. The staleness gate never accepts it, and the next push goes to that engine."""


class PushAborted(RuntimeError):
    """Raised inside an engine's bucket stream when the trainer's side of the push failed, so the
    engine's transport aborts (gloo sends ABORT) instead of ending the round with partial weights."""


class _Abort:
    def __init__(self, error: BaseException):
        self.error = error


SAFETENSORS_HEADER_SLACK = 1 << 20
"""Bytes allowed per bucket file beyond its tensors (the JSON header: names, shapes, offsets)."""


def bucket_bytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged writer may still put in ``folder``'s file system."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _unshared(bucket: Bucket) -> Dict[str, torch.Tensor]:
    """The bucket as safetensors takes it: contiguous, and no two tensors sharing memory (tied embeddings
    push ``lm_head.weight`` as the embedding itself; safetensors refuses shared storages), a copy where so."""
    out, seen = {}, set()
    for name, t in bucket:
        t = t.detach().contiguous()
        key = t.untyped_storage().data_ptr()
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def pick_folder(preferred: str, needed: int, fallback: str = None) -> str:
    """``preferred`` when it has ``needed`` bytes free, else ``fallback`` (the temp dir on disk) with a
    warning; ``RuntimeError`` naming both folders and the sizes when neither has room."""
    fallback = fallback or tempfile.gettempdir()
    have = free_bytes(preferred)
    if have >= needed:
        return preferred
    if os.path.realpath(fallback) != os.path.realpath(preferred):
        spare = free_bytes(fallback)
        if spare >= needed:
            logger.warning("weight push: %s has %.1f MiB free, the push needs %.1f MiB (bucket x "
                           "max_in_flight); writing bucket files to %s instead (slower: on disk)", preferred,
                           have / 2**20, needed / 2**20, fallback)
            return fallback
        raise RuntimeError(f"weight push: no room for the bucket files: {preferred} has {have / 2**20:.1f} MiB free "
                           f"and {fallback} {spare / 2**20:.1f} MiB, the push needs {needed / 2**20:.1f} MiB "
                           "(bucket x max_in_flight); lower generation.weight_push_bucket_mb or free space")
    raise RuntimeError(f"weight push: no room for the bucket files: {preferred} has {have / 2**20:.1f} MiB free, the "
                       f"push needs {needed / 2**20:.1f} MiB (bucket x max_in_flight); lower "
                       "generation.weight_push_bucket_mb or free space")


class SharedFileFanout:
    """Publishes each bucket once as a file under ``folder`` (default /dev/shm), linked once per reader.

    A reader (an engine) owns its link: it unlinks it once read. ``wait_for_room`` bounds how many
    published buckets may still be unread; ``abandon`` removes a dead reader's links.
    """

    def __init__(self, num_readers: int, folder: str = None, max_in_flight: int = 2, poll_s: float = 0.002):
        self.num_readers, self.max_in_flight, self.poll_s = num_readers, max_in_flight, poll_s
        self.preferred = folder or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.folder = self.preferred
        self._published: List[List[str]] = []
        self._count = 0
        self.bytes_written = 0

    def publish(self, bucket: Bucket, name: Optional[str] = None) -> List[str]:
        """Writes ``bucket`` once; returns one path per reader (hard links of that file). The folder
        is chosen per bucket (``pick_folder``): room for this bucket and the others in flight. ``name``: the
        file's name in ``folder``, which must have the room (a stage leader's file, where rank 0 looks for it:
        ``stage_push.py``)."""
        needed = (bucket_bytes(bucket) + SAFETENSORS_HEADER_SLACK) * self.max_in_flight
        if name is None:
            self.folder = pick_folder(self.folder, needed)  # after a fallback (warned once) stays on the fallback
            fd, base = tempfile.mkstemp(prefix="megatron-grpo-bucket-", suffix=".safetensors", dir=self.folder)
            os.close(fd)
        else:
            pick_folder(self.folder, needed, fallback=self.folder)  # no other folder: an error when full
            base = os.path.join(self.folder, name)
        try:
            from safetensors.torch import save_file

            save_file(_unshared(bucket), base)  # one copy (as fast as a hand-made writer)
            self.bytes_written += sum(t.numel() * t.element_size() for _, t in bucket)
            links = [base] + [f"{base}.{r}" for r in range(1, self.num_readers)]
            for link in links[1:]:
                os.link(base, link)
        except BaseException:
            _unlink(base)
            raise
        self._published.append(links)
        self._count += 1
        return links

    def unread(self) -> int:
        """Published buckets some reader has not read yet."""
        self._published = [links for links in self._published if any(os.path.exists(p) for p in links)]
        return len(self._published)

    def wait_for_room(self, reading: Callable[[int], bool]) -> None:
        """Blocks while ``max_in_flight`` buckets are unread; ``reading(r)`` False drops reader r's links."""
        while self.unread() >= self.max_in_flight:
            for r in range(self.num_readers):
                if not reading(r):
                    self.abandon(r)
            time.sleep(self.poll_s)

    def abandon(self, reader: int) -> None:
        """Removes reader ``reader``'s links (it died, or stopped reading after an error)."""
        for links in self._published:
            _unlink(links[reader])

    def close(self) -> None:
        """Removes whatever is left (after an error)."""
        for links in self._published:
            for path in links:
                _unlink(path)
        self._published = []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fan_out(buckets: Iterable[Bucket], engines: Sequence, version: int, *, names: Callable[[int], str] = None,
            max_in_flight: int = 2, stages=None) -> List[str]:
    """Pushes ``buckets`` to every engine of ``engines`` at once; returns the names pushed.

    Each engine implements the file-push seam: ``begin_weight_push()``, ``push_file(path)`` (takes
    ownership of ``path`` and unlinks it once read), ``end_weight_push(version)``. The buckets are
    consumed completely even when an engine fails (the gathers behind them are collective). The
    first engine error is re-raised after every engine has finished, with ``engine_index`` set.
    ``stages`` (``stage_push.StageFiles``): stages > 0's files, handed to every engine as they become ready
    beside ``buckets`` (stage 0's); a stage's error ends the push on every engine (as a failed gather does).
    """
    fanout = SharedFileFanout(len(engines), max_in_flight=max_in_flight)
    feeds, done = [queue.Queue() for _ in engines], [threading.Event() for _ in engines]
    errors: List[BaseException] = [None] * len(engines)
    pushed, lock, aborted = [], threading.Lock(), []

    def feed(r: int) -> None:
        try:
            errors[r] = _feed_files(engines[r], iter(feeds[r].get, None), version)
        finally:
            done[r].set()

    def dispatch(r: int, path: str) -> None:  # a stage's file (collector thread)
        with lock:
            if aborted or done[r].is_set():
                _unlink(path)
            else:
                feeds[r].put(path)

    def reading(r: int) -> bool:
        return not done[r].is_set() and _alive(engines[r])

    with ThreadPoolExecutor(max_workers=len(engines) + 1, thread_name_prefix="weight-push") as pool:
        futures = [pool.submit(feed, r) for r in range(len(engines))]
        collector = None if stages is None else pool.submit(stages.collect, dispatch, reading)
        try:
            for bucket in buckets:
                pushed.extend(name for name, _ in bucket)
                _publish(fanout, bucket, feeds, reading, done)
            failure = None if collector is None else collector.result()
            if failure is not None:
                raise PushAborted(failure)
        except BaseException as exc:
            with lock:
                aborted.append(exc)
                for f in feeds:
                    f.put(_Abort(exc))
            raise
        finally:
            if collector is not None:
                wait([collector])  # the stages' leaders finish whatever rank 0 does
            for f in feeds:
                f.put(None)
            for fut in futures:
                fut.result()
            fanout.close()
            if stages is not None:
                stages.close()
    _raise_first(errors, names)
    return pushed


def _publish(fanout: SharedFileFanout, bucket: Bucket, feeds, reading, done) -> None:
    """One bucket written once and handed to the engines still reading (none left: the gathers go on, nothing
    is written)."""
    fanout.wait_for_room(reading)
    live = [r for r in range(len(feeds)) if not done[r].is_set()]
    if not live:
        return
    for r, path in enumerate(fanout.publish(bucket)):
        if r in live:
            feeds[r].put(path)
        else:
            _unlink(path)


def _feed_files(engine, paths: Iterable, version: int):
    """One engine's side of ``fan_out``: its reload, each bucket file, the end with ``version``. Returns
    its error (None). A trainer-side abort, or a live engine that refused a bucket, closes the reload
    with ``UNKNOWN_VERSION`` (a remote server is not restarted; half-reloaded layers cannot generate)."""
    ending = False
    try:
        engine.begin_weight_push()
        for path in paths:
            if isinstance(path, _Abort):  # the trainer's gather failed
                version = UNKNOWN_VERSION
                break
            engine.push_file(path)
        ending = True
        engine.end_weight_push(version)
        return None
    except BaseException as exc:  # noqa: BLE001 - reported after the push
        for path in paths:  # the rest of this engine's buckets are never read
            if not isinstance(path, _Abort):
                _unlink(path)
        if not ending and _alive(engine):
            try:
                engine.end_weight_push(UNKNOWN_VERSION)
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        return exc


def fan_out_streams(buckets: Iterable[Bucket], engines: Sequence, version: int, *,
                    names: Callable[[int], str] = None) -> List[str]:
    """Pushes ``buckets`` to engines that stream them themselves (``engine.update_weights(stream,
    version)``: vLLM's weight-transfer API), one thread per engine, each bucket handed to every
    live engine. Consumed completely whatever fails; the first error is re-raised after all have
    finished, with ``engine_index`` set (and the engine named)."""
    feeds = [queue.Queue(maxsize=2) for _ in engines]
    errors: List[BaseException] = [None] * len(engines)
    done = [threading.Event() for _ in engines]
    pushed: List[str] = []

    def stream(r: int):
        item = feeds[r].get()
        while item is not None:
            if isinstance(item, _Abort):
                raise PushAborted(f"the trainer's side of the push failed: {type(item.error).__name__}: "
                                  f"{item.error}")
            yield item
            item = feeds[r].get()

    def run(r: int) -> None:
        try:
            engines[r].update_weights(stream(r), version)
        except BaseException as exc:  # noqa: BLE001 - reported after the push
            errors[r] = exc
        finally:
            done[r].set()

    def hand(r: int, item) -> None:
        while not done[r].is_set():
            try:
                return feeds[r].put(item, timeout=0.05)
            except queue.Full:
                continue

    with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="weight-stream") as pool:
        futures = [pool.submit(run, r) for r in range(len(engines))]
        end = None
        try:
            for bucket in buckets:
                pushed.extend(name for name, _ in bucket)
                for r in range(len(engines)):
                    hand(r, bucket)
        except BaseException as exc:
            end = _Abort(exc)
            raise
        finally:
            for r in range(len(engines)):
                hand(r, end)
            for fut in futures:
                fut.result()
    _raise_first(errors, names)
    return pushed


def _raise_first(errors: List[BaseException], names: Callable[[int], str] = None) -> None:
    for r, exc in enumerate(errors):
        if exc is not None:
            exc.engine_index = r
            if names is not None:
                exc.engine_name = names(r)
                exc.args = (f"{names(r)}: {exc}",) + tuple(exc.args[1:])
            raise exc


def _alive(engine) -> bool:
    alive = getattr(engine, "alive", None)
    return alive() if alive is not None else True
