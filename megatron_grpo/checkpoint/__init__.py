"""Checkpoints: atomic folders, a run's state saved and resumed, sharded optimizer state, HF export."""
