"""Bounded staleness for asynchronous GRPO: train on rollouts at most ``max_staleness`` versions old."""

from __future__ import annotations


class StalenessGate:
    """Accepts a rollout batch made by weights version j while the trainer is at version k iff k - j <= max."""

    def __init__(self, max_staleness: int):
        if max_staleness < 0:
            raise ValueError(f"generation.max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.dropped = 0

    def accept(self, rollout_version: int, trainer_version: int, count: int = 1) -> bool:
        """True if usable; otherwise counts ``count`` dropped rollouts."""
        if rollout_version > trainer_version:
            raise AssertionError(f"rollout version {rollout_version} is newer than the trainer's {trainer_version}")
        if trainer_version - rollout_version <= self.max_staleness:
            return True
        self.dropped += count
        return False
