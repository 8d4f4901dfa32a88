"""Reward functions: a registry plus ``module:function`` for user code.

A reward function is called as ``fn(completion_ids=[[int]], texts=[str or None],
prompt_ids=[[int]])`` and returns one finite number per completion. ``texts`` are decoded with special tokens
kept, so a stopped completion ends with its stop token (verl and TRL strip special tokens).
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Callable, List, Optional, Sequence

import torch

from megatron_grpo.parallel import comm
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


REWARD_MAX_ABS = 3.0e38
"""Rewards must fit float32 (the loss's precision): 1e300 is finite in Python but inf there."""


def compute_rewards(fn: Callable, name: str, step: int, completion_ids, texts: Optional[Sequence[Optional[str]]],
                    prompt_ids, timeout_s: Optional[float] = None) -> torch.Tensor:
    """Calls the reward (at most ``timeout_s`` seconds) and checks it: one real number per
    completion, finite in float32, else a clear error naming the function and the step."""
    values = _call(fn, name, step, timeout_s, dict(completion_ids=completion_ids, texts=texts, prompt_ids=prompt_ids))
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or getattr(values, "ndim", 1) != 1:
        shape = f" of shape {tuple(values.shape)}" if hasattr(values, "shape") else ""
        raise ValueError(f"reward function {name!r} at step {step} must return a list of numbers (one per "
                         f"completion), got {type(values).__name__}{shape}")
    if len(values) != len(completion_ids):
        raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {len(completion_ids)} "
                         f"completions at step {step}")
    wrong = [i for i, v in enumerate(values) if not _is_number(v)]
    if wrong:
        raise ValueError(f"reward function {name!r} at step {step} returned a non-number for completion {wrong[0]}: "
                         f"{values[wrong[0]]!r} ({type(values[wrong[0]]).__name__})")
    values = [float(v) for v in values]
    bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and abs(v) <= REWARD_MAX_ABS)]
    if bad:
        raise ValueError(f"reward function {name!r} returned non-finite rewards (or beyond float32's range) at step "
                         f"{step} (completions {bad[:5]}{'...' if len(bad) > 5 else ''}: {values[bad[0]]!r})")
    return torch.tensor(values, dtype=torch.float64)  # advantages are computed in float64


def agreed_timeout_s(timeout_s: Optional[float], collective_timeout_minutes: float, world_size: int) -> Optional[float]:
    """Rank 0's limit on one reward call: ``reward.timeout_s``, or, when unset and other ranks wait in
    the broadcast, 90% of ``cluster.distributed_timeout_minutes``, so rank 0 reports a hung reward to
    every rank before their collective times out with a bare gloo/NCCL error."""
    if timeout_s is not None or world_size == 1:
        return timeout_s
    return 0.9 * 60.0 * collective_timeout_minutes


def score_once(fn: Callable, name: str, step: int, completion_ids, decode: Callable, prompt_ids,
               timeout_s: Optional[float] = None, rank: int = 0) -> torch.Tensor:
    """Rewards scored once, on global rank 0, and broadcast: every rank gets the same tensor, or the
    same error (a user's reward may be slow, stateful or call a service: N ranks must not call it N
    times). The other ranks wait in the broadcast, bounded by ``cluster.distributed_timeout_minutes``;
    rank 0's call is bounded by ``reward.timeout_s``. ``decode(ids)`` gives the texts (rank 0 only)."""
    result = None
    if rank == 0:
        try:
            rewards = compute_rewards(fn, name, step, completion_ids, decode(completion_ids), prompt_ids, timeout_s)
            result = ("ok", rewards.tolist())  # Python floats: float64, exact through pickle
        except (ValueError, RuntimeError) as exc:
            result = (type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - anything else (decoding, a malformed return) must reach
            result = ("RuntimeError", f"scoring with reward function {name!r} failed at step {step}: "  # every rank
                                      f"{type(exc).__name__}: {exc}")
    status, value = comm.broadcast_object(result, src=0)
    if status != "ok":
        raise (ValueError if status == "ValueError" else RuntimeError)(value)
    return torch.tensor(value, dtype=torch.float64)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point())


def _call(fn: Callable, name: str, step: int, timeout_s: Optional[float], kwargs):
    """Runs the user's reward, in a daemon thread when a timeout is set (a hung reward cannot be
    killed, but the run stops with a clear error instead of hanging forever)."""
    box = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - user code; re-raised below
            box["error"] = exc

    if timeout_s is None:
        target()
    else:
        worker = threading.Thread(target=target, daemon=True, name=f"reward-{name}")
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise RuntimeError(f"reward function {name!r} did not return within reward.timeout_s={timeout_s} s "
                               f"at step {step}")
    if "error" in box:
        exc = box["error"]
        raise RuntimeError(f"reward function {name!r} raised at step {step}: {type(exc).__name__}: {exc}") from exc
    return box["value"]
