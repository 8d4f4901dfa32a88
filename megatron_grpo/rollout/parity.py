"""Parity probe: after a weight push, the generator and the trainer's shadow forward must agree.

A wrong name map, a missed TP shard or a dropped tensor shows up here as a log-prob gap
far above the dtype's tolerance, instead of as a silently flat reward curve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
"""Mean |log-prob diff| allowed per dtype. Measured on the tiny Qwen3 (vLLM full low
precision vs our autocast shadow forward, 96 tokens): fp32 2e-7, fp16 2-4e-4, bf16
1.5-3e-3 (mean); ENVIRONMENT.md measured 1e-2 mean for bf16 vLLM vs bf16 transformers.
A stale down_proj in one layer gave 0.046; larger models and larger mistakes give more."""


class ParityError(RuntimeError):
    """The generator's log-probs do not match the trainer's after a push."""


@dataclass
class ProbeBatch:
    """Fixed sequences to score: ``sequences[i][prompt_lens[i]:]`` are the scored tokens."""

    sequences: List[List[int]]
    prompt_lens: List[int]

    @classmethod
    def synthetic(cls, vocab_size: int, num: int = 4, length: int = 24, prompt_len: int = 4, seed: int = 1234):
        gen = torch.Generator().manual_seed(seed)
        seqs = torch.randint(0, vocab_size, (num, length), generator=gen).tolist()
        return cls(seqs, [prompt_len] * num)


def compare(engine_lp: Sequence[Sequence[float]], trainer_lp: Sequence[Sequence[float]]) -> Dict[str, float]:
    """Mean and max |diff| over all scored tokens."""
    diffs = torch.tensor([abs(a - b) for ea, eb in zip(engine_lp, trainer_lp) for a, b in zip(ea, eb)],
                         dtype=torch.float64)
    return {"sync/logprob_abs_diff_mean": diffs.mean().item(), "sync/logprob_abs_diff_max": diffs.max().item()}


def check_parity(engine, probe: ProbeBatch, trainer_scores: Callable[[ProbeBatch], List[List[float]]],
                 pushed_names: Sequence[str], tolerance: float, version: int) -> Dict[str, float]:
    """Scores ``probe`` with the engine and the trainer; raises ``ParityError`` above ``tolerance``."""
    ours = trainer_scores(probe)
    theirs = engine.score(probe.sequences, probe.prompt_lens)
    metrics = compare(theirs, ours)
    if metrics["sync/logprob_abs_diff_mean"] > tolerance:
        raise ParityError(parity_message(metrics, tolerance, pushed_names, version))
    return metrics


def parity_message(metrics: Dict[str, float], tolerance: float, pushed_names: Sequence[str], version: int) -> str:
    shown = ", ".join(pushed_names[:12]) + (f", ... ({len(pushed_names)} in all)" if len(pushed_names) > 12 else "")
    return (f"weight push of version {version} failed the parity probe: generator vs trainer log-probs differ by "
            f"{metrics['sync/logprob_abs_diff_mean']:.4g} on average (max {metrics['sync/logprob_abs_diff_max']:.4g}), "
            f"tolerance {tolerance:.3g}. Pushed tensors: {shown}. A missing or mis-named tensor, or a TP/EP shard "
            f"gathered wrongly, gives this.")
