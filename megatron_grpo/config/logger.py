"""The logger's recipe schema (``logger.*``): metrics.jsonl, TensorBoard, the progress bar, and the optional
Weights & Biases / MLflow trackers. Re-exported by ``megatron_grpo.config.schema``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class WandbConfig:
    """Weights & Biases run (NeMo-RL's ``logger.wandb``); used when ``logger.wandb_enabled``."""

    project: str = "megatron-grpo"
    """W&B project."""
    name: Optional[str] = None
    """Run name; null = the log dir's name."""
    mode: str = "offline"
    """``offline`` (no network; ``wandb sync`` later), ``online`` or ``disabled``."""

    def __post_init__(self):
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.wandb.mode must be offline, online or disabled, got {self.mode!r}")


@dataclass
class MLflowConfig:
    """MLflow run (NeMo-RL's ``logger.mlflow``); used when ``logger.mlflow_enabled``."""

    experiment_name: str = "megatron-grpo"
    """MLflow experiment."""
    run_name: Optional[str] = None
    """Run name; null = the log dir's name."""
    tracking_uri: Optional[str] = None
    """Tracking server or store; null = a local file store ``file:<log_dir>/mlruns`` (no network)."""


@dataclass
class LoggerConfig:
    """Metrics output (key names follow NeMo-RL's ``logger`` where they exist)."""

    log_dir: str = "runs/grpo"
    """Folder of ``metrics.jsonl``, ``config.yaml``, ``summary.json`` (and TensorBoard events)."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is installed."""
    tensorboard_enabled: Optional[bool] = None
    """NeMo-RL's name for ``tensorboard``; when set, it wins."""
    wandb_enabled: bool = False
    """Also log to Weights & Biases (``pip install '.[wandb]'``)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B project, run name and mode."""
    mlflow_enabled: bool = False
    """Also log to MLflow (``pip install '.[mlflow]'``)."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    """MLflow experiment, run name and tracking URI."""
    progress_bar: bool = True
    """Live progress bar with reward, beta and phantom-clip fraction."""
    token_dump_steps: List[int] = field(default_factory=list)
    """Steps whose per-token log-probs (rollout, trainer, shadow) and advantages are written to
    ``tokens_step<N>.json`` (rank 0's rows), for the ratio scatter of ``megatron-grpo plot``."""

    def __post_init__(self):
        if self.tensorboard_enabled is not None:
            self.tensorboard = self.tensorboard_enabled
