"""Fault injection for drills and tests: inert unless the environment variable is set.

- ``MEGATRON_GRPO_FAULT_KILL_AFTER_STEP=N``: SIGKILL this process right after step N is
  logged (and checkpointed, if due) - a node lost between steps.
- ``MEGATRON_GRPO_FAULT_NAN_STEP=N``: one NaN in the first micro-batch's log-probs at step N.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

import torch

KILL_AFTER_STEP = "MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"
NAN_AT_STEP = "MEGATRON_GRPO_FAULT_NAN_STEP"


def env_step(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value else None


def maybe_kill(step: int) -> None:
    if env_step(KILL_AFTER_STEP) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_nan(step: int, microbatch: int, log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log_probs`` with a NaN at the first valid token when the fault is armed for this step."""
    if env_step(NAN_AT_STEP) != step or microbatch != 0:
        return log_probs
    poison = torch.zeros_like(log_probs)
    index = mask.nonzero()[0]
    poison[index[0], index[1]] = float("nan")
    return log_probs + poison
