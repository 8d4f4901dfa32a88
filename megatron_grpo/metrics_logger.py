"""Per-step metrics: one host sync, then metrics.jsonl (appended, flushed), TensorBoard, progress bar."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Optional

import torch


def stack_metrics(metrics: Dict[str, object]):
    """``(names, values [n] float64)``: the tensor metrics stacked where they live. Every one must
    be on the same device (the model's): a stray CPU tensor among CUDA ones is named here,
    instead of costing a host sync of its own or failing inside ``torch.stack``."""
    names = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not names:
        return names, None
    devices = {metrics[k].device for k in names}
    if len(devices) > 1:
        first = metrics[names[0]].device
        others = [k for k in names if metrics[k].device != first]
        raise AssertionError(f"step metrics live on several devices ({', '.join(map(str, devices))}): "
                             f"{', '.join(others[:8])} not on {first}")
    return names, torch.stack([metrics[k].detach().double().reshape(()) for k in names])


def to_host(metrics: Dict[str, object]) -> Dict[str, float]:
    """Converts a dict of 0-dim tensors / numbers to floats with a single device->host copy."""
    names, stacked = stack_metrics(metrics)
    values = stacked.tolist() if names else []
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    out.update(zip(names, values))
    return dict(sorted(out.items()))


class MetricsLogger:
    """Writes one JSON object per step (``step`` + metrics) on the logging rank."""

    def __init__(self, log_dir: str, *, enabled: bool, tensorboard: bool, progress_bar: bool, total_steps: int,
                 start_step: int = 0, resumed: bool = False):
        self.enabled = enabled
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._tb = self._bar = None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if resumed:
            self._drop_rows_after(start_step)
        elif os.path.isfile(self.path):  # a fresh run never deletes an earlier run's metrics
            os.replace(self.path, f"{self.path}.{time.strftime('%Y%m%d-%H%M%S')}.bak")
        self._file = open(self.path, "a")
        if tensorboard:
            self._tb = _tensorboard_writer(log_dir)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="GRPO", dynamic_ncols=True)

    def _drop_rows_after(self, checkpoint_step: int) -> None:
        """On resume, rows of steps after the checkpoint (to be recomputed) are removed; one row per step."""
        if not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= checkpoint_step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                  beta=f"{metrics.get('precision/beta_abs_mean', float('nan')):.2e}",
                                  phantom=f"{metrics.get('clip/phantom_region_fraction', float('nan')):.3f}")
            self._bar.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _tensorboard_writer(log_dir: str) -> Optional[object]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # noqa: BLE001 - tensorboard is optional
        return None
    return SummaryWriter(log_dir)
