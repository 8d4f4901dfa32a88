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
    collected now (they stay queued, as ``Collected``) and as plain data (loadable with ``weights_only=True``).
    A generator failing here: nothing is saved in flight and the queue is emptied (the next steps regenerate
    them, as after any generator failure)."""
    try:
        done = collections.deque(h if isinstance(h, Collected) else Collected(engine.collect(h)) for h in pending)
    except GeneratorError as exc:
        logger.warning("collecting the generations in flight for the checkpoint failed (%s); the next steps "
                       "regenerate them", str(exc).splitlines()[0])
        return collections.deque(), []
    saved = [{"step": step + i, "prompts": planned[step + i][0], "sampling": dataclasses.asdict(planned[step + i][1]),
              "rollouts": h.rollouts.to_state()} for i, h in enumerate(done)]
    return done, saved


def restore(saved: Optional[List[dict]], max_staleness: int) -> Optional[Tuple[Deque, Dict[int, tuple]]]:
    """The queue and planned (prompts, sampling) of a checkpoint's generations in flight; None for a checkpoint
    written before they were saved (an async run's next ``max_staleness`` steps are then generated anew)."""
    if saved is None:
        if max_staleness:
            logger.warning("this checkpoint holds no generations in flight (written by an older version): the next "
                           "%d step(s) train on rollouts of the resumed weights", max_staleness)
        return None
    pending = collections.deque(Collected(Rollouts.from_state(g["rollouts"])) for g in saved)
    return pending, {g["step"]: (g["prompts"], Sampling(**g["sampling"])) for g in saved}
