"""Fault injection for drills and tests: inert unless the environment variable is set.

- ``MEGATRON_GRPO_FAULT_KILL_AFTER_STEP=N``: SIGKILL this process right after step N is
  logged (and checkpointed, if due) - a node lost between steps.
- ``MEGATRON_GRPO_FAULT_NAN_STEP=N``: one NaN in the first micro-batch's log-probs at step N.
- ``MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP=N``: SIGKILL the generator (vLLM process or
  server) just before step N generates - a generator crash.
- ``MEGATRON_GRPO_FAULT_KILL_GENERATOR=phase:N[,phase:N ...]``: SIGKILL the generator just
  before step N's ``generate``, weight ``push`` or parity ``probe``; ``start:K`` SIGKILLs the
  K-th generator process this run starts (a vLLM engine; 1 = the first, 2 = the first restart)
  right after it is spawned, so it dies while starting: ``generate:2,start:2`` kills the generator
  during step 2's generation and again while it restarts.
"""

from __future__ import annotations

import itertools
import os
import signal
from typing import Optional

import torch

KILL_AFTER_STEP = "MEGATRON_GRPO_FAULT_KILL_AFTER_STEP"
NAN_AT_STEP = "MEGATRON_GRPO_FAULT_NAN_STEP"
KILL_GENERATOR_STEP = "MEGATRON_GRPO_FAULT_KILL_GENERATOR_STEP"
KILL_GENERATOR = "MEGATRON_GRPO_FAULT_KILL_GENERATOR"
_generator_killed = set()
_generator_starts = itertools.count(1)


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


def _armed_generator_kills() -> set:
    armed = {("generate", env_step(KILL_GENERATOR_STEP))}
    for item in filter(None, os.environ.get(KILL_GENERATOR, "").split(",")):
        phase, _, step = item.partition(":")
        armed.add((phase.strip(), int(step)))
    return armed


def maybe_kill_generator(step: int, engine, phase: str = "generate") -> None:
    """Kills the engine's process once when armed for (``phase``, ``step``) (rank 0 only holds an engine)."""
    if engine is None or (phase, step) not in _armed_generator_kills() or (phase, step) in _generator_killed:
        return
    _generator_killed.add((phase, step))
    engine.kill_process()


def maybe_kill_starting_generator(process) -> None:
    """Counts the generator processes this run starts; kills ``process`` (just spawned, not yet
    ready) when it is the one armed as ``start:K``."""
    if ("start", next(_generator_starts)) in _armed_generator_kills():
        process.kill()
