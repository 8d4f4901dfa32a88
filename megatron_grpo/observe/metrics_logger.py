"""Per-step metrics: one host sync, then metrics.jsonl (appended, flushed), TensorBoard, progress bar,
and optionally Weights & Biases / MLflow (imported only when chosen). ``read_metrics_rows`` is the one
reader of metrics.jsonl (torch-free, for the doctor, plots, summary and sweep tools)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import pathlib
import time
from typing import Any, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)


def read_metrics_rows(path: str, *, repair: bool = False) -> List[Dict[str, Any]]:
    """The rows (JSON objects) of the metrics file ``path``. The writer appends each row with one
    write + flush + fsync, so a crash or a full disk can tear only the last line: a torn (unparsable)
    last line is dropped with a warning naming the file and line, and with ``repair`` the file is
    truncated before it (and a last row missing its newline gets one). An unparsable line before the
    last is a ValueError naming the file and line (the file was edited or damaged otherwise)."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    rows = []
    for lineno, line in numbered:
        row = _parse_row(line)
        if row is None and lineno != numbered[-1][0]:
            raise ValueError(f"{path} line {lineno}: not a JSON object ({line[:60]!r}); only the last line can be "
                             f"torn by a crash, so this file was damaged otherwise: fix or remove that line")
        if row is None:
            logger.warning("%s line %d: torn last row (%d bytes, a crash or full disk mid-write) %s", path, lineno,
                           len(line), "removed: file truncated" if repair else "ignored")
            if repair:
                _truncate_at_line(path, lines, lineno - 1)
            return rows
        rows.append(row)
    if repair and numbered and numbered[-1][0] == len(lines):  # a complete last row without its newline
        with open(path, "ab") as f:
            f.write(b"\n")
    return rows


def _parse_row(line: bytes) -> Optional[Dict[str, Any]]:
    try:
        row = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    return row if isinstance(row, dict) else None


def _truncate_at_line(path: str, lines: List[bytes], index: int) -> None:
    """Cuts ``path`` before line ``index`` (0-based) of its ``lines`` and fsyncs it."""
    with open(path, "r+b") as f:
        f.truncate(sum(len(line) + 1 for line in lines[:index]))
        f.flush()
        os.fsync(f.fileno())


def stack_metrics(metrics: Dict[str, object]):
    """``(names, values [n] float64)``: the tensor metrics stacked where they live. Every one must
    be on the same device (the model's): a stray CPU tensor among CUDA ones is named here,
    instead of costing a host sync of its own or failing inside ``torch.stack``."""
    import torch

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
    import torch

    names, stacked = stack_metrics(metrics)
    values = stacked.tolist() if names else []
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    out.update(zip(names, values))
    return dict(sorted(out.items()))


class MetricsLogger:
    """Writes one JSON object per step (``step`` + metrics) on the logging rank."""

    def __init__(self, log_dir: str, *, enabled: bool, tensorboard: bool, progress_bar: bool, total_steps: int,
                 start_step: int = 0, resumed: bool = False, trackers: Sequence[Any] = ()):
        self.enabled = enabled
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._tb = self._bar = None
        self._trackers: List[Any] = list(trackers)
        """Experiment trackers (W&B, MLflow): objects with ``log(step, metrics)`` and ``close()``."""
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
        """On resume, rows of steps after the checkpoint (to be recomputed) are removed, and a torn
        last row (a crash or full disk mid-write) is dropped; one row per step."""
        if not os.path.isfile(self.path):
            return
        rows = read_metrics_rows(self.path, repair=True)
        kept = [row for row in rows if row.get("step", 0) <= checkpoint_step]
        if len(kept) == len(rows):
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")  # one write, flushed and fsynced: a crash tears only this row
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        for tracker in self._trackers:
            tracker.log(step, metrics)
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                  beta=f"{metrics.get('precision/beta_abs_mean', float('nan')):.2e}",
                                  phantom=f"{metrics.get('clip/phantom_region_fraction', float('nan')):.3f}")
            self._bar.update(1)

    def write(self, message: str) -> None:
        """Prints a line without breaking the progress bar (rank 0 only)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Idempotent: closes the file, TensorBoard, the trackers and the progress bar."""
        if not self.enabled or self._file.closed:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()
        if self._bar is not None:
            self._bar.close()


def _tensorboard_writer(log_dir: str) -> Optional[object]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # noqa: BLE001 - tensorboard is optional
        return None
    return SummaryWriter(log_dir)


def _flat(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (recipe keys as typed in overrides)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _require(module: str, key: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{key}=true needs the {module} package: pip install '.[{module}]'") from exc


class WandbTracker:
    """A Weights & Biases run (``mode: offline`` writes under ``<log_dir>/wandb`` with no network)."""

    def __init__(self, cfg, log_dir: str, config: Dict[str, Any]):
        wandb = _require("wandb", "logger.wandb_enabled")
        os.makedirs(log_dir, exist_ok=True)
        self._run = wandb.init(project=cfg.project, name=cfg.name or os.path.basename(os.path.abspath(log_dir)),
                               dir=log_dir, mode=cfg.mode, config=config)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowTracker:
    """An MLflow run; without ``tracking_uri`` a local file store ``file:<log_dir>/mlruns`` (no network)."""

    def __init__(self, cfg, log_dir: str, config: Dict[str, Any]):
        _require("mlflow", "logger.mlflow_enabled")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking_uri or pathlib.Path(os.path.abspath(log_dir), "mlruns").as_uri()
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(cfg.experiment_name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(cfg.experiment_name)
        run_name = cfg.run_name or os.path.basename(os.path.abspath(log_dir))
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, str(v)[:250]) for k, v in sorted(_flat(config).items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        for i in range(0, len(rows), 1000):
            self._client.log_batch(self.run_id, metrics=rows[i:i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def build_trackers(cfg, config: Dict[str, Any]) -> List[Any]:
    """The experiment trackers ``cfg`` (a ``LoggerConfig``) enables, each given the resolved ``config``."""
    trackers = []
    if cfg.wandb_enabled:
        trackers.append(WandbTracker(cfg.wandb, cfg.log_dir, config))
    if cfg.mlflow_enabled:
        trackers.append(MLflowTracker(cfg.mlflow, cfg.log_dir, config))
    return trackers
