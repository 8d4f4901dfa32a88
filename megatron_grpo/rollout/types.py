"""Rollout data types and the engine interface every backend implements."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import torch


@dataclass
class Sampling:
    """Sampling settings for one ``generate`` call."""

    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    """Base seed: completion i of prompt p uses seed + p * n + i (deterministic, distinct samples)."""
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    """Generate exactly ``max_tokens`` tokens: no stop at the model's EOS ids or ``stop_token_ids``
    (vLLM's ``ignore_eos``; every completion finishes with ``"length"``)."""


@dataclass
class Rollout:
    """One completion: what was sampled, with which log-probs, by which weights."""

    prompt_index: int
    prompt_ids: List[int]
    completion_ids: List[int]
    logprobs: List[float]
    """Generator log-probs of each completion token under the distribution sampled from (temperature applied)."""
    finish_reason: str
    policy_version: int
    text: Optional[str] = None
    routed_experts: Optional[object] = None
    """R3 only: the experts vLLM routed each position to, ``[positions, layers, top-k]`` ints over
    prompt + completion (the last sampled token is never forwarded); None when not requested."""


@dataclass
class Rollouts:
    """Completions of one ``generate`` call, grouped prompt by prompt (n consecutive per prompt)."""

    items: List[Rollout] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def to_state(self) -> List[dict]:
        """Plain data (loadable with ``torch.load(weights_only=True)``): a checkpoint's in-flight rollouts."""
        rows = []
        for r in self.items:
            row = asdict(r)
            if r.routed_experts is not None:
                row["routed_experts"] = torch.as_tensor(r.routed_experts)
            rows.append(row)
        return rows

    @classmethod
    def from_state(cls, rows: List[dict]) -> "Rollouts":
        return cls([Rollout(**row) for row in rows])


@dataclass
class Collected:
    """A generation already collected (an engine-independent handle): the in-flight rollouts a checkpoint
    saved (``GRPOTrainer.in_flight_state``), trained on after a resume exactly as the uninterrupted run would."""

    rollouts: Rollouts


class RolloutEngine:
    """Interface of a generator backend (registered in ``ROLLOUT_ENGINES``)."""

    dtype: torch.dtype
    policy_version: int = 0
    shares_trainer_weights: bool = False
    """True for an engine that generates with the trainer's own (sharded) model (``megatron``): it
    lives on every rank, every rank calls it with the same inputs, and no weights are pushed to it."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling) -> Rollouts:
        """``n`` completions per prompt with per-token log-probs."""
        raise NotImplementedError

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> List[List[float]]:
        """Log-probs of ``sequences[i][prompt_lens[i]:]`` given their prefixes (temperature 1)."""
        raise NotImplementedError

    def score_replicas(self, sequences: Sequence[Sequence[int]],
                       prompt_lens: Sequence[int]) -> List[Tuple[Optional[str], List[List[float]]]]:
        """(name, scores) of every replica holding the weights (a pool: each engine; the parity probe
        checks each); a single engine is its only replica (name None)."""
        return [(None, self.score(sequences, prompt_lens))]

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> List[str]:
        """Loads HF-named tensors (streamed) into the generator; returns the names loaded."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases the generator."""

    def kill_process(self) -> None:
        """Kills the generator abruptly (fault drills)."""
        raise NotImplementedError

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class GeneratorError(RuntimeError):
    """The generator process failed, died, or did not answer in time."""
