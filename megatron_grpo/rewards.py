"""Reward functions: a registry plus ``module:function`` for user code.

A reward function is called as ``fn(completion_ids=[[int]], texts=[str or None],
prompt_ids=[[int]])`` and returns one finite number per completion.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch

from megatron_grpo.registry import Registry, _import_dotted

REWARDS = Registry("reward function")


@REWARDS.register("negative_length")
def negative_length(completion_ids: Sequence[Sequence[int]], **kwargs) -> List[float]:
    """The write-up's task: reward = -len(completion); the optimum emits EOS at once."""
    return [-float(len(ids)) for ids in completion_ids]


def get_reward_fn(name: str) -> Callable:
    """A registered reward, or ``module:function``."""
    if ":" in name and name not in REWARDS:
        fn = _import_dotted(name)
        if not callable(fn):
            raise ValueError(f"reward.name={name!r} is not callable")
        return fn
    return REWARDS.get(name)


def compute_rewards(fn: Callable, name: str, step: int, completion_ids, texts: Optional[Sequence[Optional[str]]],
                    prompt_ids) -> torch.Tensor:
    """Calls the reward and checks it: one finite float per completion, else a clear error."""
    try:
        values = fn(completion_ids=completion_ids, texts=texts, prompt_ids=prompt_ids)
    except Exception as exc:  # noqa: BLE001 - user code
        raise RuntimeError(f"reward function {name!r} raised at step {step}: {type(exc).__name__}: {exc}") from exc
    try:
        values = [float(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward function {name!r} at step {step} must return numbers, got {type(values).__name__}") from exc
    if len(values) != len(completion_ids):
        raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {len(completion_ids)} "
                         f"completions at step {step}")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"reward function {name!r} returned non-finite rewards at step {step} "
                         f"(completions {bad[:5]}{'...' if len(bad) > 5 else ''})")
    return torch.tensor(values, dtype=torch.float64)  # advantages are computed in float64
