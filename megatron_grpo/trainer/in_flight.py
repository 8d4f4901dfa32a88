"""The generations in flight at a checkpoint (``generation.max_staleness`` >= 1), saved and requeued.

An async run submits step s+1's generation before step s trains (weights version s - 1), and its prompts are
drawn then: the data position a checkpoint saves after step s is already past them. Saving the collected
rollouts with their prompts and sampling lets a resumed run train step s+1 on exactly the rollouts the
uninterrupted run trains on (tested in ``tests/test_pool.py``); without them it would draw the next prompts and
generate them with the resumed weights (one step on-policy, one batch of prompts skipped).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Deque, Dict, List, Optional, Tuple

from megatron_grpo.rollout.types import Collected, GeneratorError, Rollouts, Sampling

logger = logging.getLogger(__name__)


def collect(pending: Deque, planned: Dict[int, tuple], engine, step: int) -> Tuple[Deque, List[dict]]:
    """Rank 0, at a save after ``step`` steps: the handles in ``pending`` (for step indices step, step+1, ...)
    collected now (they stay queued, as ``Collected``) and, as plain data (loadable with ``weights_only=True``),
    every planned step from ``step`` on: its prompts and sampling, with its rollouts where collected. A planned
    step without a handle (its generation failed or was cleared by a generator restart; the live run regenerates
    it with the same prompts and seeds) is saved with ``rollouts`` None, so a resumed run regenerates those
    prompts too instead of skipping them (the saved data position is past them). A generator failing here: no
    rollouts are saved and the queue is emptied (the next steps regenerate them, as after any generator failure)."""
    try:
        done = collections.deque(h if isinstance(h, Collected) else Collected(engine.collect(h)) for h in pending)
    except GeneratorError as exc:
        logger.warning("collecting the generations in flight for the checkpoint failed (%s); the next steps "
                       "regenerate them", str(exc).splitlines()[0])
        done = collections.deque()
    saved = [{"step": k, "prompts": planned[k][0], "sampling": dataclasses.asdict(planned[k][1]),
              "rollouts": done[k - step].rollouts.to_state() if k - step < len(done) else None}
             for k in sorted(planned) if k >= step]
    return done, saved


DISTRIBUTION_FIELDS = ("temperature", "top_p", "top_k")
"""The ``Sampling`` fields that define the distribution the generator's log-probs (the old log-probs) are of."""


def restore(saved: Optional[List[dict]], max_staleness: int,
            current: Optional[Sampling] = None) -> Optional[Tuple[Deque, Dict[int, tuple]]]:
    """The queue and planned (prompts, sampling) of a checkpoint's generations in flight; None for a checkpoint
    written before they were saved (an async run's next ``max_staleness`` steps are then generated anew).
    ``current``: the resumed recipe's sampling; where a saved step's temperature / top-p / top-k differ from it,
    its rollouts are dropped and it is regenerated (same prompts and seed) with the current ones: the trainer
    computes its log-probs at the current temperature, so rollouts sampled at another would give wrong ratios."""
    if saved is None:
        if max_staleness:
            logger.warning("this checkpoint holds no generations in flight (written by an older version): the next "
                           "%d step(s) train on rollouts of the resumed weights", max_staleness)
        return None
    planned = {g["step"]: (g["prompts"], _resampled(Sampling(**g["sampling"]), current)) for g in saved}
    pending = collections.deque()
    for g in saved:  # the collected generations lead; the steps after the first without rollouts regenerate
        if g["rollouts"] is None or planned[g["step"]][1] != Sampling(**g["sampling"]):
            break
        pending.append(Collected(Rollouts.from_state(g["rollouts"])))
    return pending, planned


def _resampled(sampling: Sampling, current: Optional[Sampling]) -> Sampling:
    """``sampling`` with ``current``'s distribution fields (a warning when they differ)."""
    if current is None:
        return sampling
    changed = {k: getattr(current, k) for k in DISTRIBUTION_FIELDS if getattr(sampling, k) != getattr(current, k)}
    if not changed:
        return sampling
    logger.warning("the checkpoint's generations in flight were sampled with %s; the recipe now sets %s: they are "
                   "regenerated with it", {k: getattr(sampling, k) for k in changed}, changed)
    return dataclasses.replace(sampling, **changed)
